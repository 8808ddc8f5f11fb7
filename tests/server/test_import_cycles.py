"""No import circle between modules of the server and bench packages (any import, also one
inside a function): a circle means two files share one concept, or one of them is in the
wrong layer (as `launch/launch.py` <-> `launch/options.py` once were)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "asynchicache"
CHECKED = ("server", "bench")


def _module(path: Path) -> str:
    return ".".join(("asynchicache", *path.relative_to(PKG).with_suffix("").parts))


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for part in CHECKED for p in (PKG / part).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.add(node.module)
                targets |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_circles() -> None:
    graph = _graph()
    assert len(graph) > 20  # the walk found the packages
    cycles = [c for m in sorted(graph) if (c := _cycle_from(m, graph)) is not None]
    assert cycles == []
