"""`lazy_face`: a package's `__init__` that names its exports and loads each on first use.

A face maps each public name to the module of the package that defines it (PEP 562), so
importing one module of a package (as a lower layer does) loads none of the others: the
storage faces keep redis-py and ZeroMQ out of a process that only needs `storage.base`.

This module imports nothing of asynchicache, so every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_face(
    package: str, module_of: Mapping[str, str]
) -> tuple[list[str], Callable[[str], object]]:
    """`__all__` and the module `__getattr__` of `package`, whose name `n` lives in
    `package.<module_of[n]>`."""
    names = dict(module_of)

    def getattr_(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return sorted(names), getattr_
