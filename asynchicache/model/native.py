"""Native kernels: C sources in `kernels/`, built once per machine with its C compiler.

The paged attention kernel (`kernels/paged_attention.c`) reads K and V where
they lie in the page pool; torch has no operation that attends over a page
table without first gathering the pages into a contiguous copy. The row
kernels (`kernels/row_ops.c`, used through `row_ops.py`) do a decoder layer's
row-wise steps in one pass each. Both go into one library (so a process has
both or neither: one numerics version).

Every x86 host gets vector code that fits it: the library is built per
instruction set (`ISAS`: AVX-512 as `-march=x86-64-v4`, AVX2 as
`-march=x86-64-v3`; other machines `-march=native`), and `host_isa()` picks the
widest one the CPU has from its flags at run time (`$ASYNCHICACHE_KERNEL_ISA`
forces one the CPU has: tests and benches run the AVX2 path on an AVX-512 host).
Its vectors are as wide as the hardware's (`kernels/vec.h`: 16 lanes on AVX-512,
8 on AVX2; GCC leaves a vector wider than the hardware's in memory and compares
and shuffles it lane by lane: 16-lane code built for AVX2 attended ~100x slower).
The lanes order the sums (chunks of keys, reduction trees), so the two builds give
other last bits and their pages other namespaces (`numerics_version`: 16 lanes
NATIVE_NUMERICS_VERSION, 8 lanes NATIVE8_NUMERICS_VERSION). The build checks that
it vectorised: the source fails to compile when the compiler did not target the
width asked for, and the loaded library reports the width it was built for.

A build lands in a cache folder (`$ASYNCHICACHE_KERNEL_DIR`, else
`$XDG_CACHE_HOME/asynchicache/kernels`, else `~/.cache/asynchicache/kernels`),
named by a hash of the source, the compiler's version and the flags (the ISA's
among them), so a changed source or another instruction set builds anew. A
build goes to a temporary name and is renamed into place, so processes
building at once never load half a file.

Without a compiler (or when the build fails) `load()` returns None and logs
why once; the engine then attends with torch (`attention.py`). The calls go
through ctypes, which releases the GIL while the kernel runs.

Who runs a call's parts: torch's own OpenMP threads (`kernels/team.c`, built with
-fopenmp; its libgomp is the one torch loaded, `team_of`), so the row kernels and the
attention run on the threads that run the matmuls. Before, a Python worker thread ran the
other part beside OpenMP's threads; on 2 cores they took each other's core at every op
of a prefill (docs/benchmarks.md: torch's ops won whole prefills though ours won each op
alone). Without OpenMP the Python threads still share calls (`KernelThreads.share`).
Either way every row and task is one thread's: the numbers do not depend on the split.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = (KERNELS / "paged_attention.c", KERNELS / "row_ops.c", KERNELS / "team.c")
HEADERS = (KERNELS / "vec.h",)
MAX_Q = 96  # query vectors per block (the C source's MAX_Q)
MAX_D = 256  # largest head_dim (MAX_D)
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno")
# The kernels' calls run on torch's OpenMP threads (kernels/team.c); a compiler without
# OpenMP builds them without (each call then shared by Python threads, `KernelThreads`).
OPENMP_FLAGS = ("-fopenmp",)
# The OpenMP runtimes' libraries: two of them loaded are two pools of threads.
OPENMP_LIBS = ("libgomp", "libiomp", "libomp")
# Tests set it to build into a fresh folder; operators to a shared one.
DIR_ENV = "ASYNCHICACHE_KERNEL_DIR"
# Forces an instruction set (a name of ISAS) the CPU has, e.g. avx2 on an AVX-512 host.
ISA_ENV = "ASYNCHICACHE_KERNEL_ISA"


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: its compiler flags, the vector bytes the source must see
    (`VEC_BYTES` in kernels/vec.h; 0: whatever the host has) and the CPU flags it needs."""

    name: str
    flags: tuple[str, ...]
    vector_bytes: int
    cpu_flags: frozenset[str] = frozenset()


# x86-64-v4 and -v3 as GCC and clang define them (the CPU flags are /proc/cpuinfo's names).
ISAS = {
    "avx512": Isa("avx512", ("-march=x86-64-v4", "-DVEC_EXPECT=64"), 64,
                  frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                             "avx2", "fma", "bmi2"})),
    "avx2": Isa("avx2", ("-march=x86-64-v3", "-DVEC_EXPECT=32"), 32,
                frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})),
    "native": Isa("native", ("-march=native",), 0),
}  # fmt: skip

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_ptr = ctypes.c_void_p


def _cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asynchicache" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not); read
    once (a many-core host's /proc/cpuinfo is long)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def host_isa(flags: frozenset[str] | None = None) -> Isa:
    """The widest build this CPU runs: AVX-512, else AVX2, on x86; `native` elsewhere. An
    x86 without AVX2 gets `native` too, which `load` refuses (see there)."""
    flags = cpu_flags() if flags is None else flags
    if _x86():
        for name in ("avx512", "avx2"):
            if ISAS[name].cpu_flags <= flags:
                return ISAS[name]
    return ISAS["native"]


def runnable_isas() -> tuple[str, ...]:
    """The builds this CPU runs, widest first (an AVX-512 host runs the AVX2 one too)."""
    if not _x86():
        return ("native",)
    flags = cpu_flags()
    return tuple(name for name in ("avx512", "avx2") if ISAS[name].cpu_flags <= flags)


def chosen_isa() -> Isa:
    """`$ASYNCHICACHE_KERNEL_ISA` where it names a build this CPU runs, else `host_isa()`."""
    host = host_isa()
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted:
        return host
    isa = ISAS.get(wanted)
    if isa is None:
        log.warning("%s=%s is not one of %s; using %s", ISA_ENV, wanted, sorted(ISAS), host.name)
        return host
    if not isa.cpu_flags <= cpu_flags():
        log.warning("%s=%s: this CPU lacks %s; using %s", ISA_ENV, wanted,
                    sorted(isa.cpu_flags - cpu_flags()), host.name)  # fmt: skip
        return host
    return isa


def _build(cc: str, folder: Path, isa: Isa | None = None) -> Path:
    """The library of `isa` for this source and compiler, with OpenMP where `cc` has it."""
    try:
        return _build_with(cc, folder, isa or host_isa(), OPENMP_FLAGS)
    except RuntimeError as exc:
        log.warning("the kernels built without OpenMP (%s): Python threads share calls", exc)
        return _build_with(cc, folder, isa or host_isa(), ())


def _build_with(cc: str, folder: Path, isa: Isa, extra: tuple[str, ...]) -> Path:
    flags = (*FLAGS, *extra, *isa.flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(source + version.encode() + " ".join(flags).encode()).hexdigest()[:20]
    target = folder / f"kernels-{isa.name}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-I", str(KERNELS), "-o", tmp, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class RowKernels:
    """The row kernels of the built library (`kernels/row_ops.c`), each over rows [r0, r1)
    of float32 CPU tensors whose rows are contiguous (strides in floats)."""

    lib: ctypes.CDLL

    # `threads`: 0 runs rows [r0, r1) on this thread; n > 0 shares them among n of torch's
    # OpenMP threads (kernels/team.c; only where the library has a team, `team_of`).
    def _call(self, name: str, threads: int, *args: object) -> None:
        if threads:
            getattr(self.lib, f"{name}_team")(*args, threads)
        else:
            getattr(self.lib, name)(*args)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float,
                 r0: int, r1: int, threads: int = 0) -> None:  # fmt: skip
        self._call("rms_norm_f32", threads, x.data_ptr(), x.stride(0), w.data_ptr(),
                   out.data_ptr(), out.stride(0), x.shape[1], eps, r0, r1)  # fmt: skip

    def add_rms_norm(self, res: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                     out: torch.Tensor, eps: float, r0: int, r1: int,
                     threads: int = 0) -> None:  # fmt: skip
        self._call("add_rms_norm_f32", threads, res.data_ptr(), res.stride(0),
                   delta.data_ptr(), delta.stride(0), w.data_ptr(), out.data_ptr(),
                   out.stride(0), res.shape[1], eps, r0, r1)  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor, r0: int, r1: int,
                 threads: int = 0) -> None:  # fmt: skip
        self._call("silu_mul_f32", threads, gate_up.data_ptr(), gate_up.stride(0),
                   out.data_ptr(), out.stride(0), out.shape[1], r0, r1)  # fmt: skip

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r0: int,
               r1: int, threads: int = 0) -> None:  # fmt: skip
        """x [T, heads, head_dim] (heads contiguous in a row); cos/sin [T, head_dim / 2]."""
        self._call("rotary_f32", threads, x.data_ptr(), x.stride(0), x.shape[1], x.shape[2],
                   cos.data_ptr(), sin.data_ptr(), cos.stride(0), r0, r1)  # fmt: skip

    def scatter_rows(self, pool: torch.Tensor, src: torch.Tensor, pages: torch.Tensor,
                     offsets: torch.Tensor, r0: int, r1: int,
                     threads: int = 0) -> None:  # fmt: skip
        """pool: a layer's K or V view [pages, page_size, kv_heads, hd]; src [T, kv_heads, hd]."""
        self._call("scatter_rows_f32", threads, pool.data_ptr(), pool.stride(0),
                   pool.stride(1), src.data_ptr(), src.stride(0), src.shape[1] * src.shape[2],
                   pages.data_ptr(), offsets.data_ptr(), r0, r1)  # fmt: skip

    @staticmethod
    def bind(lib: ctypes.CDLL) -> RowKernels:
        """Declare the row kernels' ctypes signatures, each with its team's (every one
        returns nothing)."""
        signatures = {
            "rms_norm_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _i64, _i64],
            "add_rms_norm_f32": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _i64, _i64],
            "silu_mul_f32": [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64],
            "rotary_f32": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64],
            "scatter_rows_f32": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64],
        }
        for name, argtypes in signatures.items():
            for fn, types in ((getattr(lib, name), argtypes),
                              (getattr(lib, f"{name}_team"), [*argtypes, _i32])):  # fmt: skip
                fn.restype = None
                fn.argtypes = types
        return RowKernels(lib)


def team_of(lib: ctypes.CDLL) -> bool:
    """Whether `lib`'s calls may run on OpenMP teams (kernels/team.c): it was built with
    OpenMP, and the process has one OpenMP runtime (torch's: a second one would be a
    second pool of threads beside torch's, the contention the teams are there to end)."""
    built = lib.kernel_team
    built.restype, built.argtypes = _i32, []
    if not built():
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    runtimes = {line.split()[-1] for line in maps.splitlines()
                if Path(line.split()[-1]).name.startswith(OPENMP_LIBS)}  # fmt: skip
    if len(runtimes) != 1:
        log.warning("OpenMP runtimes %s: Python threads share the kernels' calls", runtimes)
    return len(runtimes) == 1


@dataclass(frozen=True)
class PagedAttentionKernel:
    """`paged_attention_f32` of the built library, with its ctypes signature, and the
    library's row kernels beside it (`rows`)."""

    library: Path
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    rows: RowKernels
    isa: str = "native"  # the build that runs (a name of ISAS)
    lanes: int = 16  # of its vectors: they order its sums (the pages' numerics version)
    team: bool = False  # calls run on torch's OpenMP threads (`team_of`)

    def __call__(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
                 work: KernelWork, window: int, part: int = 0, parts: int = 1,
                 threads: int = 0) -> None:  # fmt: skip
        """Attention of `work` over one layer, in place into `out`.

        k, v: the layer's [pages, page_size, kv_heads, head_dim] views of the pool
        (strided; each page's [page_size, kv_heads, head_dim] contiguous); q:
        [T, heads, head_dim] float32 with contiguous rows of heads x head_dim (a view of
        the fused projection is fine); out: [T, heads, head_dim] contiguous; window: keys
        a row sees back from itself (0: all). Threads
        share a layer by `part` of `parts` (tasks strided, see the C source), or, with
        `threads` > 0, that many of torch's OpenMP threads share the whole call (`team`)."""
        _, page_size, kv_heads, head_dim = k.shape
        heads = q.shape[1]
        args = (
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), heads, kv_heads, head_dim,
            page_size, window, work.scale, q.data_ptr(), q.stride(0), out.data_ptr(),
            work.tables.data_ptr(), work.items.data_ptr(), work.items.shape[0],
        )  # fmt: skip
        if threads:
            rc = self.rows.lib.paged_attention_f32_team(*args, threads)
        else:
            rc = self.fn(*args, part, parts)
        if rc != 0:
            raise ValueError(
                f"paged attention kernel: unsupported shape (heads {heads}, kv heads "
                f"{kv_heads}, head_dim {head_dim})"
            )


@dataclass(frozen=True)
class KernelWork:
    """A batch as the kernel takes it (built once per forward, `runner.py`)."""

    tables: torch.Tensor  # int64 [pages]: every sequence's page table, one after another
    items: torch.Tensor  # int64 [n, 4]: table offset, first row, rows, first row's position
    scale: float  # of the scores (1 / sqrt(head_dim))
    tasks: int  # (item, block of rows, KV head) triples: what threads share

    @staticmethod
    def count_tasks(rows: Sequence[int], kv_heads: int, group: int) -> int:
        """Tasks of items of `rows` rows each, as the C source cuts them: an item whose
        query vectors fit a block (MAX_Q) is one; else one per block of rows and KV head."""
        per_block = MAX_Q // group
        heads = kv_heads * group
        return sum(1 if n * heads <= MAX_Q else kv_heads * -(-n // per_block) for n in rows)


@dataclass(frozen=True)
class KernelThreads:
    """The native kernel and the threads that share each of its calls: torch's OpenMP
    threads where the kernel has a team (`PagedAttentionKernel.team`), else the calling
    thread and `workers` (ctypes releases the GIL, so they run at once)."""

    kernel: PagedAttentionKernel
    workers: Executor | None = None

    def parts(self) -> int:
        """Threads a call may be split among: torch's thread count (which the engine's
        governor sets), where a team or workers share calls; else 1."""
        shared = self.kernel.team or self.workers is not None
        return torch.get_num_threads() if shared else 1

    def share(self, call: Callable[[int, int], object], parts: int) -> None:
        """call(part, parts) for each part: part 0 on this thread, the others on the
        workers at once; returns when every part did (parts <= 1: one call here)."""
        if parts <= 1 or self.workers is None:
            call(0, 1)
            return
        others = [self.workers.submit(call, part, parts) for part in range(1, parts)]
        call(0, parts)
        for done in others:
            done.result()

    def run(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, out: torch.Tensor,
            work: KernelWork, window: int) -> None:  # fmt: skip
        """Attention of `work` over one layer, its tasks shared by the threads."""
        parts = min(self.parts(), work.tasks)
        if self.kernel.team and parts > 1:
            self.kernel(k, v, q, out, work, window, threads=parts)
            return
        self.share(lambda part, n: self.kernel(k, v, q, out, work, window, part, n), parts)


def supports(dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
    """Shapes the kernel takes (see the C source: MAX_D, MAX_Q); the rest use torch.
    `group`: query heads per KV head."""
    return (
        dtype == torch.float32
        and device.type == "cpu"
        and head_dim % 16 == 0
        and head_dim <= MAX_D
        and group <= MAX_Q
    )


def load(isa: str | None = None) -> PagedAttentionKernel | None:
    """The paged attention kernel (and the row kernels) of build `isa` (a name of ISAS;
    None: `chosen_isa()`), built on first use (once per process and build: a loaded
    library is the process's anyway); None where it cannot be built or the CPU cannot
    run it, with the reason logged."""
    return _load(chosen_isa() if isa is None else ISAS[isa])


@functools.cache
def _load(isa: Isa) -> PagedAttentionKernel | None:
    if isa.name == "native" and _x86():
        # SSE's 16-byte vectors: GCC would run the 16-lane code lane by lane, slower than
        # torch's own ops (as it did for AVX2 before its 8-lane build).
        log.warning("an x86 CPU without AVX2: torch's ops instead of the native kernels")
        return None
    if not isa.cpu_flags <= cpu_flags():
        log.warning(
            "the %s kernels need CPU flags %s", isa.name, sorted(isa.cpu_flags - cpu_flags())
        )
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler: attention gathers pages and uses torch (slower)")
        return None
    try:
        path = _build(cc, _cache_dir(), isa)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:  # built with OpenMP, but no runtime of it to load
            log.warning("the kernels' OpenMP build did not load (%s); built without", exc)
            path = _build_with(cc, _cache_dir(), isa, ())
            lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as exc:
        log.warning("paged attention kernel not built (%s); using torch", exc)
        return None
    width = lib.kernel_vector_bytes
    width.restype, width.argtypes = _i32, []
    if isa.vector_bytes and width() != isa.vector_bytes:  # the #error in vec.h guards it too
        log.warning("the %s kernels were built for %d-byte vectors, not %d; using torch",
                    isa.name, width(), isa.vector_bytes)  # fmt: skip
        return None
    lanes = lib.kernel_lanes
    lanes.restype, lanes.argtypes = _i32, []
    fn = lib.paged_attention_f32
    team_fn = lib.paged_attention_f32_team
    fn.restype = team_fn.restype = _i32
    args: list[type[ctypes._SimpleCData]] = [
        _ptr, _ptr, _i64, _i64, _i32, _i32, _i32, _i32, _i64, _f32, _ptr, _i64, _ptr, _ptr,
        _ptr, _i64]  # fmt: skip
    fn.argtypes, team_fn.argtypes = [*args, _i64, _i64], [*args, _i32]
    team = team_of(lib)
    log.info("native kernels: the %s build (%d lanes), %s, calls on %s", isa.name, lanes(),
             path.name, "OpenMP's threads" if team else "Python threads")  # fmt: skip
    return PagedAttentionKernel(path, fn, RowKernels.bind(lib), isa.name, lanes(), team)


def main() -> int:
    """`python -m asynchicache.model.native`: build (or find) the library this host
    runs, so a first start does not pay the compiler (~5 CPU-s); prints the build."""
    logging.basicConfig(level=logging.INFO)
    isa = chosen_isa()
    kernel = load()
    if kernel is None:
        print(f"no native kernels on this host ({isa.name}): torch's ops")
        return 1
    print(f"{kernel.isa} ({kernel.lanes} lanes): {kernel.library}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
