"""The live-server helpers live with the fault tests (tests/faults/fault_helpers.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
