"""The core modules that setup.py compiles, loaded uncompiled too: their .py files run as plain
Python under other names, so that tests can hold the compiled build to its own source."""

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import service.core

# The functions and array holders of each compiled module that the rest of the core calls (lru.py and
# probe_hash.py are called by prefix_index.py only, from C: CIMPORTED).
CALLED = {
    "page_ops": ("pop", "release", "page_slots", "FreeStack"),
    "batching": ("unzip_appends", "decode_plan", "decode_apply"),
    "prefix_index": ("commit", "match", "evict", "IndexArrays"),
    "token_ids": ("int64_bytes",),
}
# Names a compiled module takes from another one's C functions (cimport): its source loaded
# uncompiled gets them from the other module's source.
CIMPORTED = {
    "prefix_index": (("lru", ("acquire", "check_lru", "lru_push")), ("probe_hash", ("check_seed", "probe_hash")))
}


def load_source(name: str) -> ModuleType:
    """service/core/<name>.py run as plain Python (module name `_source_<name>`), beside its build."""
    if f"_source_{name}" in sys.modules:
        return sys.modules[f"_source_{name}"]
    path = Path(service.core.__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_source_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert not module.COMPILED
    if name in CIMPORTED:
        for other, names in CIMPORTED[name]:
            for fn in names:
                setattr(module, fn, getattr(load_source(other), fn))
    return module


def use_source_build() -> Callable[[], None]:
    """Route the core's calls into the compiled modules to their uncompiled source; returns the undo."""
    saved = []
    for name, functions in CALLED.items():
        compiled, source = importlib.import_module(f"service.core.{name}"), load_source(name)
        for fn in functions:
            saved.append((compiled, fn, getattr(compiled, fn)))
            setattr(compiled, fn, getattr(source, fn))

    def undo() -> None:
        for module, fn, original in saved:
            setattr(module, fn, original)

    return undo


@pytest.fixture
def colliding_digests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every SHA-256 digest the core computes is the same one: the core runs from its source, whose
    SHA-256 is hashlib's, replaced here (the compiled build calls OpenSSL directly)."""

    class Colliding:
        @staticmethod
        def sha256(data: bytes) -> Any:
            return hashlib.sha256(b"same")

    undo = use_source_build()
    monkeypatch.setattr(load_source("prefix_index"), "hashlib", Colliding)
    yield
    undo()
