"""The compiled core is the one built from its .py files, and agrees with them run as plain Python.

setup.py compiles service/core/page_ops.py, batching.py, lru.py, probe_hash.py, prefix_index.py and
token_ids.py with Cython (a source tree
gets the build with `python setup.py build_ext --inplace`, an install with `pip install -e .`). Here
the same random calls go to the compiled build and to the source loaded uncompiled; results, errors
and every array afterwards must be the same. (The prefix index's program: test_prefix_index.py.)
"""

from collections.abc import Callable
from types import ModuleType
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import given

import service.core
from service.core import batching, lru, page_ops, prefix_index, probe_hash, token_ids
from tests.core.conftest import load_source
from tests.core.test_batching import Seq, appends, decode_batches, rows
from tests.core.test_page_ops import NUM_PAGES, releases, stacks

source_page_ops, source_batching = load_source("page_ops"), load_source("batching")


def test_the_core_runs_compiled() -> None:
    # Without the build every loop runs as plain Python: correct, but 10 to 200 times slower.
    modules = (page_ops, batching, lru, probe_hash, prefix_index, token_ids)
    assert service.core.compiled_modules() == {m.__name__: True for m in modules}
    assert service.core.is_compiled(), "the core is not compiled: run `python setup.py build_ext --inplace`"


def test_the_source_runs_uncompiled() -> None:
    names = ("page_ops", "batching", "lru", "probe_hash", "prefix_index", "token_ids")
    assert not any(load_source(name).COMPILED for name in names)


def same_on_both(
    fn: str, modules: tuple[ModuleType, ModuleType], arrays: list[np.ndarray], call: Callable[..., Any]
) -> None:
    """call(function, copies of arrays) on the compiled and the source module: the same outcome
    (result or error type) and the same arrays afterwards."""
    sides = []
    for module in modules:
        copies = [a.copy() for a in arrays]
        try:
            result: Any = ("ok", call(getattr(module, fn), copies))
        except (ValueError, IndexError) as exc:
            result = (type(exc).__name__, None)
        sides.append((result, copies))
    (compiled_out, compiled_arrays), (source_out, source_arrays) = sides
    assert compiled_out == source_out
    for c, s in zip(compiled_arrays, source_arrays):
        assert c.dtype == s.dtype and np.array_equal(c, s)


@given(stacks(), st.integers(0, NUM_PAGES + 1), st.sampled_from([np.int64, np.uint32]), st.integers(-1, 2))
def test_pop(stack: Any, num: int, dtype: Any, top_shift: int) -> None:
    free, top, ref_count = stack
    arrays = [free, ref_count, np.full(num, 99, dtype=dtype)]
    same_on_both("pop", (page_ops, source_page_ops), arrays, lambda f, a: f(a[0], top + top_shift, a[1], a[2]))


@given(releases())
def test_release(r: dict[str, Any]) -> None:
    table = np.array([[*r["ids"], 7, 7]], dtype=np.uint32)
    pages = table[0, : len(r["ids"])][::-1] if r["kind"] == "reversed" else np.array(r["ids"], dtype=np.int64)
    caching = r["caching"] == "on"
    arrays = [r["free"], np.array(r["refs"], dtype=np.int32), np.array(r["hashed"], dtype=np.bool_)]
    arrays.append(np.full(r["cached_len"], -5, dtype=np.int64))

    def call(f: Callable[..., Any], a: list[np.ndarray]) -> Any:
        return f(a[0], r["top"], a[1], a[2] if caching else None, pages, a[3] if caching else None)

    same_on_both("release", (page_ops, source_page_ops), arrays, call)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=6), st.integers(1, 5), st.integers(-1, 30), st.integers(0, 30))
def test_page_slots(page_ids: list[int], size: int, offset: int, count: int) -> None:
    pages = np.array(page_ids, dtype=np.uint32)
    out = np.full(count, -7, dtype=np.int64)
    same_on_both("page_slots", (page_ops, source_page_ops), [out], lambda f, a: f(pages, offset, size, a[0]))


@given(appends, st.fixed_dictionaries({"a": rows, "b": rows, "c": rows, "d": rows}))
def test_unzip_appends(appends: list[Any], row_of: dict[str, Any]) -> None:
    seqs = {seq_id: Seq(row) for seq_id, row in row_of.items()}
    assert batching.unzip_appends(seqs, appends) == source_batching.unzip_appends(seqs, appends)


@given(decode_batches(), st.integers(100, 200))
def test_decode_plan_and_apply(batch: Any, first_new_page: int) -> None:
    tables, lengths, num_pages, ref_count, rows, page_size = batch
    width = tables.shape[1]
    plan = batching.decode_plan(tables, width, lengths, ref_count, rows, page_size)
    assert plan == source_batching.decode_plan(tables, width, lengths, ref_count, rows, page_size)
    new_pages = np.arange(first_new_page, first_new_page + int((lengths[rows] % page_size == 0).sum()))
    arrays = [tables, lengths, num_pages, np.full(len(rows), -1, dtype=np.int64)]

    def call(f: Callable[..., Any], a: list[np.ndarray]) -> Any:
        return f(a[0], width, a[1], a[2], rows, new_pages, page_size, a[3])

    same_on_both("decode_apply", (batching, source_batching), arrays, call)
