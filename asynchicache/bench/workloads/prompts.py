"""The token ids a server saw for each request of a run, and the run's ideal hit rate.

Prompts are rebuilt from the workload and the answers the run received, then
rendered with the model's chat template and tokenized exactly as the server's
`/v1/chat/completions` does (`asynchicache.launch.frontend`), so page
boundaries match the cache's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asynchicache.bench.reports.run_results import RequestResult
from asynchicache.bench.workloads.ideal import Replay, replay
from asynchicache.bench.workloads.workloads import Message, Workload
from asynchicache.model.tokenizer import Tokenizer


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of `model` (None: the embedded default model), without its weights."""
    from asynchicache.launch.frontend import load_frontend

    return load_frontend(model).tokenizer


def chat_ids(tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def sent_messages(
    workload: Workload, results: Sequence[RequestResult], ok: bool = True
) -> list[list[Message]]:
    """Messages of the successful (or, `ok=False`, the failed) requests, in the order
    they were sent."""
    answers = {(r.session, r.turn): r.answer for r in results if r.ok}
    out = []
    for r in sorted((r for r in results if r.ok == ok), key=lambda r: (r.sent_s, r.index)):
        spec = workload.requests[r.index]
        earlier = [answers.get((r.session, t), "") for t in range(spec.turn)]
        out.append(workload.messages(spec, earlier))
    return out


def planned_messages(workload: Workload, placeholder: str) -> list[list[Message]]:
    """Messages in dispatch order, with `placeholder` for every answer (to size tiers)."""
    return [workload.messages(spec, [placeholder] * spec.turn) for spec in workload.requests]


def replay_messages(
    tokenizer: Tokenizer, conversations: Sequence[Sequence[Message]], page_size: int
) -> Replay:
    return replay([chat_ids(tokenizer, m) for m in conversations], page_size)


def ideal_of_run(
    workload: Workload,
    results: Sequence[RequestResult],
    model: str | None,
    page_size: int,
    tokenizer: Tokenizer | None = None,
    warm: Sequence[RequestResult] = (),
) -> dict[str, Any]:
    """The upper bound on the hit rate of what was sent (`ideal.replay`), and how our
    token counts match the server's.

    Built from the workload and the answers the client received (they are part
    of later prompts), never from the server's cache counters. `warm`: the
    results of an earlier run of the same workload whose pages a persistent
    cache still holds (the restart workload). Failed requests count as warm
    too: the server may have cached their prompts.
    """
    tok = tokenizer or load_tokenizer(model)
    ids = [chat_ids(tok, m) for m in sent_messages(workload, results)]
    warm_ids = [
        chat_ids(tok, m)
        for m in [
            *sent_messages(workload, warm),
            *sent_messages(workload, warm, ok=False),
            *sent_messages(workload, results, ok=False),
        ]
    ]
    rep = replay(ids, page_size, warm=warm_ids, decode_tokens=workload.max_tokens)
    ok = sorted((r for r in results if r.ok), key=lambda r: (r.sent_s, r.index))
    mismatched = sum(1 for r, t in zip(ok, ids, strict=True) if r.prompt_tokens != len(t))
    return {
        "hit_rate": rep.hit_rate,
        "hit_tokens": rep.hit_tokens,
        "prompt_tokens": rep.prompt_tokens,
        "working_set_tokens": rep.working_set_tokens,
        "page_size": page_size,
        "decode_tokens": workload.max_tokens,
        # Requests whose prompt length differs from the server's count: a
        # tokenizer or template mismatch that would make the ideal meaningless.
        "prompt_length_mismatches": mismatched,
    }
