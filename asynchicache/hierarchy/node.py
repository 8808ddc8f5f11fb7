"""`RadixNode`: one run of whole pages on one path of the radix tree (radix.py).

A node holds its pages' tokens (one flat list), their chained hashes, and per
tier the page indices where that run lives (`device`: L1 pages, `host`: L2
slots; None when the run is not in that tier). `lock_ref` and `host_ref` count
the locks and L2 holds at or below it (radix.py says what each protects).
"""

from __future__ import annotations


class RadixNode:
    """A run of whole pages on one path of the tree."""

    __slots__ = (
        "children",
        "device",
        "end_page",
        "hashes",
        "hit_count",
        "host",
        "host_ref",
        "last_access",
        "lock_ref",
        "no_store",
        "parent",
        "tokens",
    )

    def __init__(
        self, parent: RadixNode | None, tokens: list[int], hashes: list[bytes], end_page: int
    ) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.tokens = tokens  # flat, len == num_pages * page_size
        self.hashes = hashes  # chained page hashes, one per page
        self.end_page = end_page  # page depth of this node's end on its path
        self.device: list[int] | None = None  # L1 page per page of the run
        self.host: list[int] | None = None  # L2 slot per page of the run
        self.lock_ref = 0
        self.host_ref = 0
        self.last_access = 0
        self.hit_count = 0
        # Put there by a request with `cache_store: false`: never stored below L2 (until a
        # request that stores inserts the same pages).
        self.no_store = False

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    @property
    def start_page(self) -> int:
        return self.end_page - len(self.hashes)

    @property
    def is_root(self) -> bool:
        return self.end_page == 0

    def __repr__(self) -> str:
        return (
            f"RadixNode(pages {self.start_page}..{self.end_page}, device={self.device}, "
            f"host={self.host}, lock={self.lock_ref}/{self.host_ref}, t={self.last_access})"
        )
