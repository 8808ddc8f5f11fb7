"""What every endpoint needs, passed explicitly (no module-level state).

`AppContext` is built once by the launcher (or a test) and handed to
`create_app`; `TextTokenizer` is the slice of the engine's tokenizer that the
HTTP process uses to turn text into token ids and back.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from asynchicache.server.engine_client import EngineClient
from asynchicache.server.metrics import ServerMetrics
from asynchicache.storage.client.probe import ServiceProbe


class IncrementalText(Protocol):
    """Token ids in, newly completed text out (see `model.tokenizer.IncrementalDecoder`)."""

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class TextTokenizer(Protocol):
    """What the HTTP process uses of `model.tokenizer.Tokenizer`."""

    @property
    def eos_token_ids(self) -> Collection[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def fewest_tokens(self, text: str) -> int:
        """A least count of `text`'s tokens, found without tokenizing it."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_strs(self, ids: Sequence[int]) -> list[str]: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...

    def incremental_decoder(self) -> IncrementalText: ...


@dataclass(frozen=True)
class ModelInfo:
    """The served model as clients see it."""

    name: str
    max_model_len: int
    vocab_size: int
    created: int = 0
    page_size: int = 16  # tokens per KV page (--page-size): a pin covers whole pages


@dataclass
class AppContext:
    """Shared by all requests of one app. Mutable only through its members' own methods."""

    client: EngineClient
    tokenizer: TextTokenizer
    model: ModelInfo
    api_key: str | None = None
    admin_api_key: str | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # Pings the cache service for /ready (None: no disk tier, nothing to ask).
    service_probe: ServiceProbe | None = None
    # --max-request-tokens (server/guards/work_bound.py); None: its default for this context.
    max_request_tokens: int | None = None

    def __post_init__(self) -> None:
        self.metrics.bind_model(self.model.name, self.model.page_size)  # vLLM's model_name
