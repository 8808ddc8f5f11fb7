"""The keys of the security tests' shared live server (conftest.py starts it)."""

from __future__ import annotations

KEY = "s3cret-key"
ADMIN_KEY = "0perator-key"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
