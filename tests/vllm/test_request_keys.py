"""Page names cover what vLLM's block hashes cover; what cannot be named is refused.

Under vLLM's real scheduler (sched_harness.py) with our connector: two LoRA
adapters on one prompt never share a page, an adapter is named by its files
(same files under a new name hit, also after a restart from disk; other files
under the same name do not), prompt embeddings are refused (no lookup, no
save, counted). Multimodal items name the pages that hold their placeholders
(vLLM's own Request and feature objects). A failed load is recomputed under
kv_load_failure_policy "recompute" and aborts the request under "fail". On
main (27901ab) a LoRA request was served another adapter's K/V and two
embedding prompts of one length shared pages.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sched_harness import PAGE, Engine, Truth, page_is_truth, tiny_model_folder

from asynchicache.integrations.vllm.request_names import Refusal, RequestNamer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("keys-model"))


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    made = Engine(model, tmp_path_factory.mktemp("keys"))
    yield made
    made.shutdown()


def adapter(folder: Path, seed: int) -> Path:
    """A LoRA adapter's files (their bytes are all the connector reads)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "target_modules": ["k_proj"]}')
    weights = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    (folder / "adapter_model.safetensors").write_bytes(weights.numpy().tobytes())
    return folder


def lora(name: str, int_id: int, path: Path):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, str(path))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


def serve(engine: Engine, req_id: str, truth: Truth, **fields) -> float:
    """One request from lookup to finish, vLLM's own prefix cache emptied first; returns
    the tokens our tiers served. The K/V in its blocks is checked against `truth` right
    after the load (before vLLM computes the rest)."""
    engine.scheduler.reset_prefix_cache()
    before = engine.hit_tokens()
    req = engine.add(req_id, truth, max_tokens=2, **fields)
    checked = False
    for _ in range(60):
        engine.step()
        if not checked and req.num_computed_tokens:
            blocks = engine.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            upto = (len(truth.prompt) - 1) // PAGE * PAGE
            assert engine.model.wrong_positions(blocks, truth, upto) == []
            checked = True
        if req.is_finished():
            break
    engine.run()
    engine.settle()
    return engine.hit_tokens() - before


def test_two_lora_adapters_never_share_a_page(engine: Engine, tmp_path: Path) -> None:
    a, b = adapter(tmp_path / "a", 1), adapter(tmp_path / "b", 2)
    prompt = tokens(10, 6 * PAGE + 3)
    assert serve(engine, "lora-a", Truth(prompt, [5, 6], adapter=1), lora=lora("a", 1, a)) == 0
    # b on the same prompt: a's pages are no hit (b's K/V differs), b's own are saved
    assert serve(engine, "lora-b", Truth(prompt, [5, 6], adapter=2), lora=lora("b", 2, b)) == 0
    assert serve(engine, "base", Truth(prompt, [5, 6], adapter=0)) == 0
    # the same files under another name and id are the same adapter: a hit, a's K/V
    served = serve(engine, "a-again", Truth(prompt, [5, 6], adapter=1), lora=lora("x", 7, a))
    assert served == 6 * PAGE
    # other files under a's name and id are another adapter: no hit
    other = adapter(tmp_path / "a2", 3)
    assert serve(engine, "a-other", Truth(prompt, [5, 6], adapter=3), lora=lora("a", 1, other)) == 0
    in_l2 = engine.l2_pages()
    for req_id in ("lora-a", "lora-b", "base", "a-other"):
        truth = engine.truths[req_id]
        chain = engine.side.namer.chain(engine.requests[req_id]).extend(prompt)
        held = [i for i, h in enumerate(chain) if h in in_l2]
        assert len(held) == 6, (req_id, held)
        assert all(page_is_truth(in_l2[chain[i]], truth, i) for i in held), req_id


def test_lora_pages_come_back_from_disk_after_a_restart(model: Path, tmp_path: Path) -> None:
    a, b = adapter(tmp_path / "a", 1), adapter(tmp_path / "b", 2)
    prompt = tokens(11, 6 * PAGE + 3)
    first = Engine(model, tmp_path / "root")
    try:
        serve(first, "a", Truth(prompt, [5, 6], adapter=1), lora=lora("a", 1, a))
        serve(first, "b", Truth(prompt, [5, 6], adapter=2), lora=lora("b", 2, b))
    finally:
        first.shutdown()  # L2 and the service go: only the disk keeps the pages
    again = Engine(model, tmp_path / "root")
    try:
        for name, path, tag in (("b", b, 2), ("a", a, 1)):
            truth = Truth(prompt, [5, 6], adapter=tag)
            assert serve(again, f"{name}-again", truth, lora=lora(name, tag, path)) == 6 * PAGE
        assert again.stat("hit_tokens_disk") == 12 * PAGE
    finally:
        again.shutdown()


def test_an_adapter_whose_files_cannot_be_read_is_refused(engine: Engine, tmp_path: Path) -> None:
    before = engine.stat("refused_lora_unreadable")
    gone = lora("gone", 9, tmp_path / "no-such-adapter")
    assert serve(engine, "lora-gone", Truth(tokens(12, 3 * PAGE + 1), [5, 6]), lora=gone) == 0
    assert engine.stat("refused_lora_unreadable") - before == 1


def test_prompt_embeddings_are_refused_and_counted(engine: Engine) -> None:
    before = engine.stat("refused_prompt_embeds")
    n = 5 * PAGE + 1
    in_l2 = len(engine.l2_pages())
    for i, tag in enumerate((4, 5)):  # two embedding prompts of one length
        embeds = torch.full((n, 64), float(i))
        truth = Truth([0] * n, [5, 6], adapter=tag)
        assert serve(engine, f"embeds-{i}", truth, prompt_embeds=embeds) == 0
    assert engine.stat("refused_prompt_embeds") - before == 2
    assert len(engine.l2_pages()) == in_l2  # nothing saved


def test_multimodal_items_name_the_pages_that_hold_their_placeholders(engine: Engine) -> None:
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    namer = RequestNamer(engine.side.namespace, PAGE)
    ids = tokens(20, 5 * PAGE)

    def request(*items: tuple[str | None, int, int]) -> Request:
        features = [
            MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset=o, length=n))
            for ident, o, n in items
        ]
        return Request("mm", ids, SamplingParams(max_tokens=1), None, mm_features=features)

    def names(req: Request) -> list[bytes]:
        chain = namer.chain(req)
        assert not isinstance(chain, Refusal)
        return chain.extend(ids)

    plain = names(request())
    cat = names(request(("cat", 20, 20)))  # placeholders in pages 1 and 2
    dog = names(request(("dog", 20, 20)))
    assert cat[0] == dog[0] == plain[0]  # page 0 holds no placeholder
    assert len({cat[1], dog[1], plain[1]}) == 3 and cat[3] != dog[3]  # and the rest chains
    moved = names(request(("cat", 22, 18)))  # same item, other offset in the page
    assert moved[1] != cat[1]
    assert namer.chain(request(("", 20, 20))) == Refusal("mm_unnamed")


def test_a_failed_load_is_recomputed_under_policy_recompute(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = tokens(30, 4 * PAGE + 5)
    serve(engine, "fail-first", Truth(prompt, [5, 6]))
    copier = engine.worker._worker.copier

    def broken(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(copier, "load", broken)
    errors = engine.stat("load_errors")
    truth = Truth(prompt, [5, 6])
    engine.scheduler.reset_prefix_cache()
    req = engine.add("fail-again", truth, max_tokens=2)
    engine.run()
    assert engine.finished["fail-again"].finish_reason.name == "LENGTH"  # answered
    assert engine.stat("load_errors") - errors == 1
    assert req.num_computed_tokens >= len(prompt)  # recomputed


def test_a_failed_load_aborts_the_request_under_policy_fail(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    logging.getLogger("asynchicache").addHandler(caplog.handler)
    try:
        made = Engine(model, tmp_path, failure_policy="fail")
    finally:
        logging.getLogger("asynchicache").removeHandler(caplog.handler)
    assert any("kv_load_failure_policy" in r.getMessage() for r in caplog.records)
    try:
        prompt = tokens(40, 4 * PAGE + 5)
        serve(made, "first", Truth(prompt, [5, 6]))

        def broken(*args, **kwargs):
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(made.worker._worker.copier, "load", broken)
        made.scheduler.reset_prefix_cache()
        made.add("second", Truth(prompt, [5, 6]), max_tokens=2)
        made.run()
        assert made.finished["second"].finish_reason.name == "ERROR"
    finally:
        made.shutdown()


def test_a_worker_on_another_backend_turns_caching_off(engine: Engine) -> None:
    """The namespace names the attention backend the scheduler expects vLLM to select;
    a worker that reports another one (at vLLM's handshake) means no page can be named
    right: every request is refused (counted), none loads or saves. (Last here: it turns
    the module's engine off.)"""
    from asynchicache.integrations.vllm.metadata import AsynchicacheHandshake

    named = engine.side.spec.identity.attention_backend
    engine.connector.set_xfer_handshake_metadata({0: AsynchicacheHandshake(named)})
    assert engine.side.namer.refuse_all is None  # the expected one: nothing changes
    prompt = tokens(13, 4 * PAGE + 1)
    serve(engine, "before-mismatch", Truth(prompt, [5, 6]))
    engine.connector.set_xfer_handshake_metadata({0: AsynchicacheHandshake("FLASH_ATTN")})
    before = engine.stat("refused_backend_mismatch")
    in_l2 = len(engine.l2_pages())
    assert serve(engine, "after-mismatch", Truth(prompt, [5, 6])) == 0
    assert engine.stat("refused_backend_mismatch") - before == 1
    assert len(engine.l2_pages()) == in_l2
