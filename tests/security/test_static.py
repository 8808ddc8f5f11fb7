"""What the package's source may not do with untrusted data, checked on its syntax tree.

Nothing is unpickled or evaluated from a socket, a file or Redis: no pickle,
marshal, shelve (or their friends) anywhere; no eval/exec; torch.load only with
weights_only; numpy never loads pickles; msgpack never builds objects through
hooks; chat templates (which come with model files) render in jinja2's sandbox;
no shell commands. The only pickling left is `multiprocessing`'s spawn, which
hands the launcher's own config to its children over a pipe it created.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "asynchicache"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                  "joblib", "jsonpickle"}  # fmt: skip
# YAML (`serve --config`) may build arbitrary objects through its full loaders: only
# `yaml.safe_load` (plain scalars, lists and mappings) is allowed, and `yaml.compose` with
# the SafeLoader (nodes only, nothing built: to find keys given twice).
YAML_ALLOWED = {"safe_load", "YAMLError", "compose", "SafeLoader", "MappingNode"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__", "execfile", "input"}


def _trees() -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _calls() -> Iterator[tuple[str, str, ast.Call]]:
    """Every call in the package: where it is, its target's dotted name, the call."""
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                yield _where(path, node), _name(node.func), node


def _name(func: ast.expr) -> str:
    """'a.b.c' for a call target (as far as it is plain names and attributes)."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is(node: ast.expr | None, value: bool) -> bool:
    """Whether `node` is the literal `value` (True or False)."""
    return isinstance(node, ast.Constant) and node.value is value


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PKG.parent)}:{getattr(node, 'lineno', '?')}"


def test_no_unpickling_modules_anywhere() -> None:
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{_where(path, node)} imports {n}"
                for n in names
                if n.split(".")[0] in BANNED_MODULES
            ]
    assert found == []


def test_yaml_is_read_only_with_safe_load() -> None:
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "yaml":
                found.append(f"{_where(path, node)} imports names from yaml: use yaml.safe_load")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "yaml"
                and node.attr not in YAML_ALLOWED
            ):
                found.append(f"{_where(path, node)} uses yaml.{node.attr}")
    assert found == []


def test_no_eval_exec_or_shell() -> None:
    found = []
    for where, name, call in _calls():
        if name in BANNED_CALLS or name in ("os.system", "os.popen"):
            found.append(f"{where} calls {name}")
        shell = _kw(call, "shell")
        if name.startswith("subprocess.") and not (shell is None or _is(shell, False)):
            found.append(f"{where} runs a shell")
    assert found == []


def test_loaders_never_unpickle() -> None:
    found = []
    for where, name, call in _calls():
        if name.endswith("torch.load") and not _is(_kw(call, "weights_only"), True):
            found.append(f"{where} torch.load without weights_only=True")
        if name.split(".")[-1] in ("load", "loads") and name.split(".")[0] in ("np", "numpy"):
            ap = _kw(call, "allow_pickle")
            if ap is not None and not _is(ap, False):
                found.append(f"{where} numpy load with allow_pickle")
        if name.split(".")[-1] in ("unpackb", "Unpacker", "unpack"):
            for hook in ("object_hook", "object_pairs_hook", "ext_hook", "list_hook"):
                if _kw(call, hook) is not None:
                    found.append(f"{where} msgpack {hook}")
            if not _is(_kw(call, "raw"), False):
                found.append(f"{where} msgpack without raw=False")
    assert found == []


def test_msgpack_decoders_exist_and_are_the_only_ones() -> None:
    """Every msgpack decode goes through the one checked codec (asynchicache/common/codec.py)."""
    users = {
        where.split(":")[0]
        for where, name, _ in _calls()
        if name.split(".")[-1] in ("unpackb", "Unpacker", "unpack")
    }
    assert users == {"asynchicache/common/codec.py"}


def test_templates_render_in_the_sandbox() -> None:
    """Chat templates ship with model files: they must not reach Python objects."""
    found, sandboxed = [], 0
    for where, name, _ in _calls():
        last = name.split(".")[-1]
        if last in ("Environment", "Template", "NativeEnvironment"):
            found.append(f"{where} builds an unsandboxed jinja2 {last}")
        sandboxed += last in ("ImmutableSandboxedEnvironment", "SandboxedEnvironment")
    assert found == [] and sandboxed >= 1


def test_sandbox_refuses_a_hostile_template() -> None:
    import jinja2.exceptions
    import pytest

    from asynchicache.model.tokenizer import _compile

    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        _compile(evil).render(messages=[])
