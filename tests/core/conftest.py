"""The allocator and sequence tests run twice: on the compiled prefix-index loops (service/core/
_prefix.c) and on their pure-Python definitions (service/core/prefix_index.py)."""

import pytest

from service.core import prefix_index

SWAPPED = ("commit", "match", "evict", "lru_push", "lru_remove", "int64_bytes")


def use_python_prefix_index(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWAPPED:
        monkeypatch.setattr(prefix_index, name, getattr(prefix_index, f"{name}_py"))


@pytest.fixture(params=["compiled", "python"])
def prefix_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        use_python_prefix_index(monkeypatch)
    return str(request.param)
