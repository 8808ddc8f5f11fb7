"""L2 -> L3 admission: which pages are worth a disk write (--disk-admit-hits, --disk-admit-tokens).

One rule for both places that write to disk: the engine's store of L2 pages
(hierarchy.l2.writes: `hits` is the page's hit count, `tokens` its prompt's length up
to and including it) and the cache service's promotion of pages read from L4
(storage.service.tiered: a load is one hit, `tokens` the chain's length). Both limits 0
admits everything; otherwise a page is admitted when it is hot enough or its
prompt long enough. It lives in common/ because both layers apply it: the hierarchy
no longer reaches into the disk backend's folder for a policy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiskAdmission:
    """CacheConfig's two fields of the same names (one name everywhere, issue 43)."""

    disk_admit_hits: int = 0  # --disk-admit-hits (0: hits do not admit)
    disk_admit_tokens: int = 0  # --disk-admit-tokens (0: length does not admit)

    def __post_init__(self) -> None:
        if self.disk_admit_hits < 0 or self.disk_admit_tokens < 0:
            raise ValueError(
                f"--disk-admit-hits and --disk-admit-tokens must be >= 0, got "
                f"{self.disk_admit_hits} and {self.disk_admit_tokens}"
            )

    def admits(self, hits: int, tokens: int) -> bool:
        if self.disk_admit_hits == 0 and self.disk_admit_tokens == 0:
            return True
        return (0 < self.disk_admit_hits <= hits) or (0 < self.disk_admit_tokens <= tokens)
