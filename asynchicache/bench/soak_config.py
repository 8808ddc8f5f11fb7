"""One soak run's configuration (`asynchicache bench soak`'s flags)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse


@dataclass(frozen=True)
class SoakConfig:
    """One soak run."""

    url: str
    clients: int = 16
    duration_s: float = 60.0
    max_tokens: int = 12
    disconnect_rate: float = 0.1  # share of requests abandoned mid-stream on purpose
    prompts: int = 48
    prefix_lines: int = 40  # lines of each shared system prefix (about 21 tokens each)
    prefixes: int = 4  # distinct system prefixes (more than the tiers hold: L2/L3 churn)
    sample_s: float = 5.0
    warmup_s: float | None = None  # default: a fifth of the run
    api_key: str | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.clients <= 0:
            raise ValueError(f"--clients must be positive, got {self.clients}")
        if self.duration_s <= 0:
            raise ValueError(f"--duration must be positive, got {self.duration_s}")
        if not 0 <= self.disconnect_rate < 1:
            raise ValueError(f"--disconnect-rate must be in [0, 1), got {self.disconnect_rate}")
        if min(self.prompts, self.max_tokens, self.sample_s, self.prefix_lines, self.prefixes) <= 0:
            raise ValueError(
                "--prompts, --max-tokens, --sample-interval, --prefix-lines and --prefixes "
                "must be positive"
            )
        if urlparse(self.url).scheme not in ("http", "https"):
            raise ValueError(f"--url must be like http://127.0.0.1:8000, got {self.url}")

    @property
    def warmup(self) -> float:
        return self.duration_s / 5 if self.warmup_s is None else self.warmup_s

    @property
    def port(self) -> int:
        parsed = urlparse(self.url)
        return parsed.port or (443 if parsed.scheme == "https" else 80)
