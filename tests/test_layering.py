"""Imports flow one way: launch -> server -> engine -> hierarchy -> storage -> common
(bench, tools and cli are outside; model sits beside hierarchy, kv_events beside engine).

Integrations (our tiers under other engines, e.g. vLLM) sit at the server's
level: they may import engine, hierarchy, storage and common; nothing imports them.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "asynchicache"
RANK = {
    "common": 0,
    "settings": 0,
    "storage": 1,
    "hierarchy": 2,
    "model": 2,
    "engine": 3,
    "kv_events": 3,
    "server": 4,
    "integrations": 4,
    "launch": 5,
}


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


def test_nothing_imports_the_integrations() -> None:
    users = []
    for path in PKG.rglob("*.py"):
        if path.is_relative_to(PKG / "integrations"):
            continue
        users += [
            f"{path.relative_to(PKG)} imports {name}"
            for name in _imports(path)
            if name.startswith("asynchicache.integrations")
        ]
    assert users == [], "integrations are leaves:\n" + "\n".join(users)


def test_integrations_and_server_do_not_import_each_other() -> None:
    crossing = []
    for a, b in (("integrations", "server"), ("server", "integrations")):
        for path in (PKG / a).rglob("*.py"):
            crossing += [
                f"{path.relative_to(PKG)} imports {name}"
                for name in _imports(path)
                if _layer(name) == b
            ]
    assert crossing == [], "\n".join(crossing)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in it: a function's lazy
    import ties two files as much as a top-level one)."""
    paths = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                found = subs & paths.keys()
                targets |= found or ({node.module} & paths.keys())
        graph[name] = targets - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_circles_between_modules() -> None:
    """Two files that import each other (even lazily, inside a function) are one
    concept split in two, or a tool living below what it drives."""
    assert _cycles(_module_graph()) == []


MAX_MODULES_PER_FOLDER = 15


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    """A folder is one group of concepts a reader can take in: past 15 it wants a split."""
    crowded = {}
    for folder in [PKG, *(p for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(PKG.parent))] = len(modules)
    assert crowded == {}, f"folders over {MAX_MODULES_PER_FOLDER} modules: {crowded}"


def test_no_two_files_share_a_basename() -> None:
    """One name, one file: `config.py` in seven folders made every search a guess."""
    seen: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PKG)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert shared == {}, f"basenames in more than one folder: {shared}"


def test_no_layer_imports_the_tools_above_it() -> None:
    """bench/, tools/, fleet/ and the command line drive the layers; a layer that imported
    them would pull a benchmark's or a tool's dependencies into the server."""
    above = ("bench", "tools", "fleet", "cli", "__main__")
    wrong = []
    for layer in RANK:
        for path in (PKG / layer).rglob("*.py"):
            wrong += [
                f"{path.relative_to(PKG)} imports {name}"
                for name in _imports(path)
                if name.split(".")[:2][-1] in above and name.startswith("asynchicache.")
            ]
    assert wrong == [], "\n".join(wrong)
