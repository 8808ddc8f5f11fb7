"""`asynchicache serve`'s flags, one argument group per concern.

A flag that sets a config field of the same name is written as one line of a table
(asynchicache.settings.config_flags): its type and default come from the config's default
instance. Every other flag is spelled out. Each flag is its field's name, unit included
(`--storage-timeout-s` sets `storage_timeout_s`); the names of earlier releases stay as
hidden, deprecated aliases (config_flags.DEPRECATED_FLAGS; docs/operations.md).
tests/server/test_config_vocabulary.py walks every flag back to its one field.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from asynchicache.launch.compat_flags import add_compat_flags
from asynchicache.settings.config import (
    CacheConfig,
    EngineConfig,
    LaunchConfig,
    ServerConfig,
    default_disk_cache_dir,
)
from asynchicache.settings.config_flags import (
    WITH_DEFAULT,
    add_config_flags,
    add_deprecated_aliases,
    finite_float,
)
from asynchicache.storage.service.service_config import add_service_flags

API_KEY_ENV = "ASYNCHICACHE_API_KEY"
ADMIN_API_KEY_ENV = "ASYNCHICACHE_ADMIN_API_KEY"


def _add_server(p: argparse.ArgumentParser) -> None:
    s = ServerConfig()
    g = p.add_argument_group("server")
    add_config_flags(g, s, {"--host": "address to listen on", "--port": "port to listen on"})
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on all but /health and /ready "
        f"(or ${API_KEY_ENV})",
    )
    g.add_argument(
        "--admin-api-key",
        default=os.environ.get(ADMIN_API_KEY_ENV),
        help="require this key (instead of --api-key) on /cache/clear, /cache/pin, "
        f"/cache/unpin, /flush_cache and /clear_hicache_storage_backend (or ${ADMIN_API_KEY_ENV})",
    )
    g.add_argument("--served-model-name", help="model id clients send (default: the model's name)")
    g.add_argument(
        "--log-level",
        default=s.log_level,
        choices=["debug", "info", "warning", "error", "critical"],
        help="log verbosity",
    )
    add_config_flags(g, s, {
        "--startup-timeout-s": "seconds to wait for the engine to load the model",
        "--shutdown-timeout-s": "at SIGTERM, seconds running requests get to finish (then "
        "each ends with an error); each child then gets this long (at least 15 s) to stop "
        "before SIGKILL",
        "--engine-step-timeout-s": "seconds the engine may go without answering a health ping "
        "(it answers between two steps); longer, it is taken as hung: its requests end with "
        "an error, it is killed and restarted (raise it where one step of "
        "--max-prefill-tokens may take longer: a big model on a slow CPU)",
        "--request-timeout-s": "seconds a generation may take from its start to its last token; "
        "then it is aborted and answered 504 (an error event on a stream)",
    })  # fmt: skip


def _add_request_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits on a request's work")
    g.add_argument(
        "--max-request-tokens",
        type=int,
        metavar="TOKENS",
        help="most tokens one request may ask to generate (prompts x best_of x max_tokens), "
        "and a quarter of the logprob entries it may get back; more is a 400 (default: "
        "16384, or twice the context length when that is more)",
    )


def _add_engine(p: argparse.ArgumentParser) -> None:
    e = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        help="Hugging Face folder or .gguf file (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when available)"
    )
    g.add_argument(
        "--dtype",
        default=e.dtype,
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV dtype" + WITH_DEFAULT,
    )
    add_config_flags(g, e, {
        "--max-running-requests": "at most this many requests run at once; below it, a "
        "request is admitted when L1 can hold it",
    })  # fmt: skip
    g.add_argument(
        "--decode-reserve-tokens",
        type=int,
        default=e.decode_reserve_tokens,
        help="L1 room admission keeps per request for its answer, in tokens (at most its "
        "max_tokens; default %(default)s)",
    )
    add_config_flags(g, e, {
        "--chunked-prefill-size": "prompt tokens of one request prefilled per step while a short "
        "prompt is in hand or more are queued (alone, long prompts take --max-prefill-tokens)",
        "--max-prefill-tokens": "prompt tokens of all requests prefilled per step",
        "--max-step-ms": "a step's target time: its prompt chunks are sized from the measured "
        "prefill pace to end within it, so a cached request's first token never waits long "
        "behind a long prompt (default 0: no time bound; e.g. 250)",
    })  # fmt: skip
    g.add_argument(
        "--max-model-len", type=int, help="cap the context length (default: the model's)"
    )
    g.add_argument("--seed", type=int, default=e.seed, help="sampling seed of requests without one")
    add_config_flags(g, e, {
        "--min-load-tokens": "load a prefix from L2/L3/L4 only when it has at least this "
        "many tokens",
        "--prompt-logits-mib": "memory for the last-position logits of recent prompts: a "
        "prompt seen again draws its first token from them before any forward (0: off)",
    })  # fmt: skip
    g.add_argument(
        "--threads",
        type=int,
        help="torch threads of the engine process (default: every core the other processes "
        "leave free, measured as it runs; it starts at every core)",
    )


def _add_cache(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    c = CacheConfig(disk_cache_dir=None)
    g = p.add_argument_group("cache")
    add_config_flags(g, c, {
        "--page-size": "tokens per KV page",
        "--device-cache-tokens": "L1 capacity in tokens, on the engine device",
        "--host-cache-gb": "L2 shared-memory pool size in GiB (2**30 bytes); 0 disables it",
    })  # fmt: skip
    g.add_argument("--no-host-cache", action="store_true", help="disable the L2 host tier")
    g.add_argument(
        "--disk-cache-dir",
        type=Path,
        default=default_disk_cache_dir(),
        help="L3 folder, kept across restarts" + WITH_DEFAULT,
    )
    g.add_argument("--no-disk-cache", action="store_true", help="disable the L3 disk tier")
    add_config_flags(g, c, {
        "--write-policy": "when L1 pages are copied to L2",
        "--write-through-threshold": "hits before write_through_selective copies a page",
        "--prefetch-policy": "how long a request waits for its L3/L4 prefix",
        "--prefetch-timeout-s": "seconds the 'timeout' prefetch policy waits",
        "--prefetch-timeout-per-ki-token-s": "...plus these seconds per 1,024 tokens of the load",
        "--max-quarantine-fraction": "share of L2 slots that timed-out storage work may hold "
        "before new storage loads and stores pause",
    })  # fmt: skip
    g.add_argument(
        "--no-arrival-prefetch",
        dest="arrival_prefetch",
        action="store_false",
        help="start a request's L3/L4 read when it is admitted, not when it arrives "
        "(by default it moves into L2 while the request waits in the queue)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching entirely")
    g.add_argument(
        "--storage-timeout-s",
        type=finite_float,
        default=LaunchConfig.storage_timeout_s,
        metavar="SECONDS",
        help="how long the engine waits for one L3/L4 load or store of the cache service "
        "before it recomputes instead; a service silent for 3x this long is restarted"
        + WITH_DEFAULT,
    )
    return g


def _add_service(p: argparse.ArgumentParser, cache: argparse._ArgumentGroup) -> None:
    """The cache service's flags: the table `asynchicache service` reads
    too (its L3/L4 sizes and policies join the cache group)."""
    add_service_flags(cache, p.add_argument_group("cache service (the L3/L4 process)"))


def _add_kv_events(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV events (for KV-cache-aware routers)")
    g.add_argument(
        "--kv-events-endpoint",
        metavar="ADDR",
        help="publish every tier's page stores and removals on this ZeroMQ PUB address, "
        "e.g. ipc:///run/user/1000/ac/events.sock (vLLM's KVEventBatch wire format, "
        "media GPU/CPU/DISK/EXTERNAL; docs/fleet.md; default: off)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ADDR",
        help="answer replay requests (vLLM's protocol: batches from a sequence number on) on "
        "this ZeroMQ ROUTER address (vllm-router's --kv-event-replay-source)",
    )
    g.add_argument("--kv-events-topic", default=LaunchConfig.kv_events_topic, metavar="TOPIC",
                   help="the topic frame of every batch (vLLM's; default: empty)")  # fmt: skip
    g.add_argument(
        "--kv-events-pool",
        default=LaunchConfig.kv_events_pool,
        metavar="NAME",
        help="the `ownership` L4 pages (and a shared L3's) are announced under: a router "
        "credits them to every instance and keeps them when this one restarts",
    )
    g.add_argument(
        "--kv-events-shared-disk",
        action="store_true",
        help="the disk folder is shared by the fleet: announce its pages as the pool's",
    )


def _add_exposure(p: argparse.ArgumentParser) -> None:
    """Limits on what a request may cost, and who may read the KV events (docs/security.md)."""
    g = p.add_argument_group("limits")
    add_config_flags(g, ServerConfig(), {
        "--max-request-bytes": "a larger request body is answered 413 before it is read",
        "--max-concurrent-requests": "generation, /tokenize and /detokenize requests "
        "running at once (the next ones wait their turn, fewest-running key first)",
        "--max-waiting-requests": "requests waiting for a turn; past them a 429 with "
        "Retry-After (a key holding most of the queue gives up its newest place first)",
        "--header-timeout-s": "seconds a connection may take to send a whole request head "
        "(after it opens, or after its last answer) before it is closed",
    })  # fmt: skip
    g = p.add_argument_group("KV events: who may read them")
    g.add_argument(
        "--kv-events-plaintext",
        action="store_true",
        help="let the KV events go out on tcp:// without CURVE (a loopback port is readable by "
        "every local user; with --kv-events-allow-remote, by anyone who reaches it): for "
        "routers that have no CURVE, e.g. vllm-router",
    )
    g.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="let the KV event endpoints listen beyond this machine (tcp://* or another "
        "address); they need the two CURVE flags below or --kv-events-plaintext (default: "
        "ipc:// in a private folder)",
    )
    g.add_argument(
        "--kv-events-curve-secret-key",
        type=Path,
        metavar="FILE",
        help="ZeroMQ CURVE certificate of the event sockets (a .key_secret file as "
        "zmq.auth.create_certificates writes it); encrypts both sockets",
    )
    g.add_argument(
        "--kv-events-curve-clients",
        type=Path,
        metavar="DIR",
        help="folder of the CURVE public key files (.key) of the subscribers let in",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asynchicache serve",
        description="Run the OpenAI-compatible server with the hierarchical KV cache.",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE.yaml",
        help="read flags from a YAML mapping (keys: flag names, e.g. disk-cache-gb: 50); "
        "flags given on the command line win",
    )
    for add_group in (_add_server, _add_request_limits, _add_engine):
        add_group(p)
    _add_service(p, _add_cache(p))
    for add_group in (_add_kv_events, _add_exposure):
        add_group(p)
    add_compat_flags(p)  # SGLang's, LightLLM's and the seed's flags (launch/compat_flags.py)
    p.set_defaults(host_cache_tokens=None)  # L2 in tokens: only a compatibility flag sets it
    add_deprecated_aliases(p)  # the names of earlier releases (--storage-timeout, ...)
    return p
