"""The allocator and sequence tests run twice: on the compiled loops (service/core/_prefix.c,
_batch.c, _pages.c) and on their pure-Python definitions (service/core/prefix_index.py, batching.py,
page_ops.py)."""

from types import ModuleType

import pytest

from service.core import batching, page_ops, prefix_index

SWAPPED: list[tuple[ModuleType, str]] = [
    *((prefix_index, name) for name in ("commit", "match", "evict", "lru_push", "lru_remove", "int64_bytes")),
    *((batching, name) for name in ("unzip_appends", "decode_plan", "decode_apply")),
    *((page_ops, name) for name in ("pop", "release", "page_slots")),
]


def use_python_prefix_index(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, name in SWAPPED:
        monkeypatch.setattr(module, name, getattr(module, f"{name}_py"))


@pytest.fixture(params=["compiled", "python"])
def prefix_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        use_python_prefix_index(monkeypatch)
    return str(request.param)
