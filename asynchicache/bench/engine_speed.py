"""Model-side engine benchmark: our paged runner against transformers, same weights, same run.

    python -m asynchicache.bench.engine_speed [--model PATH] [--threads N] [--prompt-tokens 2048]
                                        [--device cuda] [--dtype bfloat16]

Prints one JSON object:
  prefill_tok_s       our runner (the native kernels where they fit, as the engine runs),
                      one whole prefill of a --prompt-tokens prompt
  torch_prefill_tok_s the same with torch's ops alone (no native kernel)
  kernel              the native build that ran (avx512, avx2, native; "torch": none), and
                      kernel_lanes its vectors' lanes ($ASYNCHICACHE_KERNEL_ISA forces one)
  op_choice           per op and shape class (prefill, decode rows), whether ours or torch's
                      ran (model/op_choice.py: measured once per host and build, as
                      the engine does); op_choice_torch the same in words
  matmul_gflops       this host's torch float32 matmul rate at --threads, and
                      prefill_bound_tok_s what it allows for the prompt's FLOPs
                      (prefill_gflop); prefill_of_bound: prefill_tok_s / that bound
  hf_prefill_tok_s    transformers on the same prompt, its fastest path to the first
                      token: one forward with logits_to_keep=1, float32, inference_mode
  decode_b1_tok_s     our runner, one request decoding greedily
  decode_b8_tok_s     our runner, --batch requests decoding together
  hf_decode_b1_tok_s  transformers' greedy generate, batch 1
On a GPU (`--device cuda`, transformers skipped) the record also holds the L1 <-> L2
copy bandwidth against torch's pinned copies of the same bytes (bench/micro/l1_l2_copies.py,
`--copy-pages` pages; 0 skips it, the default on the CPU).
Decode rates exclude the prompt's prefill on both sides (for transformers: the time
of generate(N + 1 tokens) minus generate(1 token)). Best of --repeats runs, our
runner and transformers taking turns so that both see the same machine load.

`collect` returns the dict, so other benchmarks (e.g. time to first token through
the cache tiers) can add their keys to the same record.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asynchicache.bench import ttft
from asynchicache.bench.micro import l1_l2_copies
from asynchicache.bench.micro.kernels import matmul_gflops, prefill_flops
from asynchicache.bench.reports.output import (
    add_output_arguments,
    bench_parser,
    print_report,
    write_report,
)
from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.sampling.sampler import sample
from asynchicache.hierarchy.pools import KVLayout
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.native import KernelThreads
from asynchicache.model.op_choice import FORWARD_TOKENS, OpChoice, measured_choice
from asynchicache.model.runner import ForwardBatch, ModelRunner, attention_kernel, prefill_timer

PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)

REPORT = "engine.json"


@dataclass(frozen=True)
class BenchArgs:
    model: str | None
    threads: int
    prompt_tokens: int
    decode_tokens: int
    batch: int
    repeats: int
    skip_hf: bool
    skip_ttft: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    copy_pages: int = 0


def _parser() -> argparse.ArgumentParser:
    parser = bench_parser("asynchicache.bench.engine_speed", __doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the cores other processes leave idle)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="only our runner")
    parser.add_argument(
        "--skip-ttft", action="store_true", help="skip time to first token through the cache tiers"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the model and L1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--copy-pages",
        type=int,
        default=None,
        help="pages of the L1 <-> L2 copy measurement (default: 512 on a GPU, 0 = skip)",
    )
    add_output_arguments(parser, REPORT)
    return parser


def bench_args(ns: argparse.Namespace) -> BenchArgs:
    threads = ns.threads if ns.threads is not None else idle_cores()
    on_cpu = torch.device(ns.device).type == "cpu"
    copy_pages = ns.copy_pages if ns.copy_pages is not None else (0 if on_cpu else 512)
    if copy_pages < 0:
        raise SystemExit(f"--copy-pages must be >= 0, got {copy_pages}")
    return BenchArgs(
        ns.model,
        threads,
        ns.prompt_tokens,
        ns.decode_tokens,
        ns.batch,
        ns.repeats,
        ns.skip_hf or not on_cpu,  # transformers' reference runs on the CPU, in float32
        ns.skip_ttft,
        ns.device,
        ns.dtype,
        copy_pages,
    )


def idle_cores() -> int:
    """Cores not busy with other processes (at least 1).

    On a shared machine, more OpenMP threads than idle cores is far slower than
    fewer: a descheduled thread stalls every barrier (we measured a batch-8
    decode step at 1.6-2.7 s with 2 threads vs 0.23 s with 1, load average 5
    on 2 cores).
    """
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


def interleaved_best(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Fastest seconds of each run, taking turns (one warm-up round first).

    Taking turns keeps a comparison fair on a machine whose load changes over
    time: both sides see the same moments, so the ratio stays meaningful.
    """
    best = {name: float("inf") for name in runs}
    for round_ in range(repeats + 1):
        for name, run in runs.items():
            seconds = run()
            if round_ > 0:
                best[name] = min(best[name], seconds)
    return best


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():  # a GPU's work is queued: time it to the end
        torch.cuda.synchronize()
    return time.perf_counter() - start


def prompt_ids(loaded: LoadedModel, n: int, seed: int) -> list[int]:
    """n ordinary (non-special) token ids of a natural-ish text."""
    text = (
        "The quick brown fox jumps over the lazy dog while the history of Paris, "
        "its rivers, bridges and museums, unfolds across two thousand years. "
    )
    ids = [i % loaded.config.vocab_size for i in loaded.tokenizer.encode(text)]
    offset = seed % len(ids)
    return [ids[(offset + i) % len(ids)] for i in range(n)]


def new_runner(loaded: LoadedModel, tokens: int, seqs: int) -> tuple[ModelRunner, list[list[int]]]:
    """A runner over a fresh pool with `seqs` page tables of `tokens` tokens each."""
    c = loaded.config
    per_seq = -(-tokens // PAGE_SIZE)
    pool = torch.zeros(
        per_seq * seqs,
        c.num_layers,
        2,
        PAGE_SIZE,
        c.num_kv_heads,
        c.head_dim,
        dtype=loaded.model.embed_tokens.weight.dtype,
        device=loaded.device,
    )
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    return ModelRunner(loaded.model, pool, PAGE_SIZE), tables


def native_runner(
    loaded: LoadedModel, tokens: int, seqs: int
) -> tuple[ModelRunner, list[list[int]]]:
    """`new_runner` with the native attention kernel where it fits and the host's choice of
    ours or torch's per op (op_choice.py), as the engine has them."""
    base, tables = new_runner(loaded, tokens, seqs)
    kernel, choice = engine_kernel(loaded)
    runner = ModelRunner(loaded.model, base.kv_pool, base.page_size, kernel, choice)
    return runner, tables


def engine_kernel(loaded: LoadedModel) -> tuple[KernelThreads | None, OpChoice]:
    """The native kernel the engine runs for `loaded` (None: torch's ops) and its choice."""
    dtype = loaded.model.embed_tokens.weight.dtype
    kernel = attention_kernel(loaded.config, dtype, torch.device(loaded.device))
    if kernel is None:
        return None, OpChoice()
    prefill = prefill_timer(loaded.model, kernel, FORWARD_TOKENS)
    return kernel, measured_choice(kernel, loaded.config, prefill=prefill)


def our_prefill(loaded: LoadedModel, args: BenchArgs, native: bool = True) -> Callable[[], float]:
    """One whole prefill of a --prompt-tokens prompt (with the native kernels where they
    fit, or torch's ops alone); returns its seconds."""
    prompt = prompt_ids(loaded, args.prompt_tokens, 0)
    make = native_runner if native else new_runner
    runner, tables = make(loaded, args.prompt_tokens, 1)
    batch = ForwardBatch([prompt], [0], tables)
    return lambda: timed(lambda: runner.forward(batch))


def kernel_name(loaded: LoadedModel) -> tuple[str, int]:
    """The native build the engine runs for `loaded` and its lanes (("torch", 0): none)."""
    kernel, _ = engine_kernel(loaded)
    return ("torch", 0) if kernel is None else (kernel.kernel.isa, kernel.kernel.lanes)


def our_decode(loaded: LoadedModel, args: BenchArgs, batch: int) -> Callable[[], float]:
    """Greedy decode of `batch` requests together; returns the seconds of the decode
    steps (the prompts' prefill is not timed)."""
    prompts = [prompt_ids(loaded, 32, seed) for seed in range(batch)]
    runner, tables = native_runner(loaded, 32 + args.decode_tokens + 1, batch)
    params, gens = [GREEDY] * batch, [None] * batch

    def run() -> float:
        logits = runner.forward(ForwardBatch(prompts, [0] * batch, tables))
        tokens = sample(logits, params, gens)
        start = time.perf_counter()
        for step in range(args.decode_tokens):
            starts = [32 + step] * batch
            logits = runner.forward(ForwardBatch([[t] for t in tokens], starts, tables))
            tokens = sample(logits, params, gens)
        return time.perf_counter() - start

    return run


def load_hf(loaded: LoadedModel) -> Any:
    """transformers' model on the same weights (the same GGUF or HF folder), float32."""
    from transformers import AutoModelForCausalLM

    if loaded.path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(loaded.path.parent), gguf_file=loaded.path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32)
    return model.eval()


def hf_prefill(hf: Any, loaded: LoadedModel, args: BenchArgs) -> Callable[[], float]:
    """transformers' fastest path to the first token: logits for the last position only."""
    ids = torch.tensor([prompt_ids(loaded, args.prompt_tokens, 0)])

    @torch.inference_mode()
    def first_token() -> None:
        hf(ids, logits_to_keep=1, use_cache=False)

    return lambda: timed(first_token)


def hf_decode_b1(hf: Any, loaded: LoadedModel, args: BenchArgs) -> Callable[[], float]:
    """Seconds of args.decode_tokens greedy steps: generate(N + 1) minus generate(1)."""
    ids = torch.tensor([prompt_ids(loaded, 32, 0)])

    @torch.inference_mode()
    def generate(n: int) -> None:
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    return lambda: timed(lambda: generate(args.decode_tokens + 1)) - timed(lambda: generate(1))


def collect(args: BenchArgs) -> dict[str, Any]:
    """Every number of this benchmark, in one dict (others may add their keys)."""
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.dtype, args.device)
    results: dict[str, Any] = {
        "model": loaded.name,
        "device": _device_name(loaded.device),
        "dtype": loaded.dtype,
        "threads": args.threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "batch": args.batch,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
    }
    results["kernel"], results["kernel_lanes"] = kernel_name(loaded)
    choice = engine_kernel(loaded)[1]
    results["op_choice"] = choice.table()  # {op: {prefill/decode: native or torch}}
    results["op_choice_torch"] = str(choice)
    hf = None if args.skip_hf else load_hf(loaded)
    prefill = {
        "prefill": our_prefill(loaded, args),
        "torch_prefill": our_prefill(loaded, args, False),
    }
    decode = {
        "decode_b1": our_decode(loaded, args, 1),
        f"decode_b{args.batch}": our_decode(loaded, args, args.batch),
    }
    if hf is not None:
        prefill["hf_prefill"] = hf_prefill(hf, loaded, args)
        decode["hf_decode_b1"] = hf_decode_b1(hf, loaded, args)
    for name, seconds in interleaved_best(prefill, args.repeats).items():
        results[f"{name}_tok_s"] = args.prompt_tokens / seconds
    for name, seconds in interleaved_best(decode, args.repeats).items():
        seqs = args.batch if name == f"decode_b{args.batch}" else 1
        results[f"{name}_tok_s"] = seqs * args.decode_tokens / seconds
    gflops = matmul_gflops(args.threads)
    flops = prefill_flops(loaded.config, args.prompt_tokens)
    bound = args.prompt_tokens * gflops * 1e9 / flops
    results |= {
        "matmul_gflops": gflops,
        "prefill_gflop": flops / 1e9,
        "prefill_bound_tok_s": bound,
        "prefill_of_bound": results["prefill_tok_s"] / bound,
    }
    if not args.skip_ttft:
        results.update(ttft.measure(loaded, args.prompt_tokens))
    if args.copy_pages:
        results.update(_copies(loaded, args))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    return device


def _copies(loaded: LoadedModel, args: BenchArgs) -> dict[str, Any]:
    """L1 <-> L2 copy GB/s of this model's pages against torch's pinned copies."""
    c = loaded.config
    dtype = loaded.model.embed_tokens.weight.dtype
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, PAGE_SIZE, dtype)
    return l1_l2_copies.measure(layout, args.copy_pages, 5, torch.device(loaded.device))


def parse_args(argv: Sequence[str] | None) -> BenchArgs:
    return bench_args(_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """One JSON record on stdout (with or without --json), kept as OUT/engine.json."""
    ns = _parser().parse_args(argv)
    record = collect(bench_args(ns))
    write_report(ns.out, REPORT, record)
    print_report(ns, record, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
