"""Which build of the native kernels a host runs (model/native.py).

An AVX-512 host runs the 16-lane build, an AVX2-only one (AMD Zen 3) the 8-lane build
(16-lane vectors on AVX2 stay in memory and go lane by lane: ~100x slower attention);
`$ASYNCHICACHE_KERNEL_ISA` forces a build the CPU runs, and the build fails rather than
load code that did not vectorise. The kernels' numbers of every build are checked in
test_paged_kernel.py, test_row_ops.py, test_numerics.py and test_models.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from asynchicache.model import native

ZEN3 = frozenset("avx avx2 fma bmi1 bmi2 f16c movbe sse4_2".split())
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.fixture
def x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")


def test_the_widest_build_the_cpu_has_is_picked(x86: None) -> None:
    assert native.host_isa(SAPPHIRE_RAPIDS).name == "avx512"
    assert native.host_isa(ZEN3).name == "avx2"
    old = native.host_isa(frozenset({"sse2", "avx"}))  # no AVX2: torch's ops, not ours
    assert old.name == "native" and native._load(old) is None


def test_an_env_var_forces_a_build_the_cpu_runs(x86: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "cpu_flags", lambda: ZEN3)
    assert native.chosen_isa().name == "avx2"
    monkeypatch.setenv(native.ISA_ENV, "avx512")  # not on this CPU: ignored
    assert native.chosen_isa().name == "avx2"
    monkeypatch.setenv(native.ISA_ENV, "neon")  # no such build: ignored
    assert native.chosen_isa().name == "avx2"
    monkeypatch.setattr(native, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setenv(native.ISA_ENV, "AVX2")
    assert native.chosen_isa().name == "avx2"
    monkeypatch.delenv(native.ISA_ENV)
    assert native.chosen_isa().name == "avx512"


def test_a_build_for_another_width_than_asked_fails(tmp_path: Path) -> None:
    """The vectorisation check: the source refuses flags that target another width."""
    cc = native._compiler()
    assert cc is not None
    wrong = native.Isa("avx2", ("-march=x86-64-v3", "-DVEC_EXPECT=64"), 64)
    if "avx2" not in native.runnable_isas():
        pytest.skip("not an x86 host with AVX2")
    with pytest.raises(RuntimeError, match="vector width"):
        native._build(cc, tmp_path, wrong)


@pytest.mark.parametrize("isa", native.runnable_isas())
def test_each_build_loads_and_runs_vector_code_of_its_width(isa: str) -> None:
    kernel = native.load(isa)
    assert kernel is not None and kernel.isa == isa
    assert kernel.lanes == (8 if isa == "avx2" else 16)
    objdump = shutil.which("objdump")
    if objdump is None or isa == "native":
        return
    text = subprocess.run([objdump, "-d", str(kernel.library)], capture_output=True, text=True)
    register = {"avx512": "%zmm", "avx2": "%ymm"}[isa]
    fmas = [line for line in text.stdout.splitlines() if "vfmadd" in line and register in line]
    assert len(fmas) > 100, f"the {isa} build has {len(fmas)} {register} FMAs: not vectorised"
    if isa == "avx2":
        assert "%zmm" not in text.stdout  # runs on a CPU without AVX-512
