"""Imports flow one way: server -> engine -> cache -> storage (bench and cli are outside)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "asynchicache"
RANK = {"storage": 0, "cache": 1, "engine": 2, "server": 3}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "asynchicache" and parts[1] in RANK:
        return parts[1]
    return None


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_imports_flow_inward_only() -> None:
    wrong = []
    for layer, rank in RANK.items():
        for path in (PKG / layer).rglob("*.py"):
            for name in _imports(path):
                target = _layer(name)
                if target is not None and RANK[target] > rank:
                    wrong.append(f"{path.relative_to(PKG)} imports {name}")
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def test_no_relative_imports_hide_layering() -> None:
    relative = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                relative.append(str(path.relative_to(PKG)))
    assert relative == [], f"use absolute imports: {relative}"
