"""Every name a package's lazy face (asynchicache.common.faces) lists loads: a module moved
or renamed without its face breaks only at first use, far from the move."""

import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "asynchicache"
FACES = sorted(
    ".".join(path.parent.relative_to(PKG.parent).parts)
    for path in PKG.rglob("__init__.py")
    if "lazy_face(" in path.read_text()
)


def test_the_faces_are_found() -> None:
    assert "asynchicache.storage" in FACES and "asynchicache.model" in FACES


@pytest.mark.parametrize("package", FACES)
def test_every_name_of_a_face_loads(package: str) -> None:
    face = importlib.import_module(package)
    missing = []
    for name in face.__all__:
        try:
            getattr(face, name)
        except (AttributeError, ImportError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == [], f"{package}'s face names what is not there:\n" + "\n".join(missing)
