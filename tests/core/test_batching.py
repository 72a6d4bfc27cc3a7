"""The compiled step helper (service/core/_batch.c) against its Python definition (batching.py)."""

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
from hypothesis import given

from service.core import batching

native = batching.native


@dataclass
class Seq:
    row: Any


def test_the_compiled_module_is_built() -> None:
    assert native is not None, "service/core/_batch.c is not built: run `pip install -e .`"


ids = st.sampled_from(["a", "b", "c", "d", "gone"])
appends = st.lists(
    st.one_of(
        st.tuples(ids, st.integers(1, 5), st.none() | st.lists(st.integers(0, 9), max_size=3)),
        st.lists(ids, min_size=3, max_size=3),  # not a tuple
        st.tuples(ids, st.integers(1, 5)),  # too short
    ),
    max_size=6,
)
rows = st.one_of(st.integers(0, 2**40), st.just(-1), st.just("3"), st.just(2.0))


@given(appends, st.fixed_dictionaries({"a": rows, "b": rows, "c": rows, "d": rows}))
def test_unzip_appends_equals_the_definition(appends: list[Any], row_of: dict[str, Any]) -> None:
    seqs = {seq_id: Seq(row) for seq_id, row in row_of.items()}
    expected = batching.unzip_appends_py(seqs, appends)
    assert native.unzip_appends(seqs, appends) == expected
    if expected is not None:
        assert expected[0] == [a[0] for a in appends] and expected[4] == (len(set(expected[0])) == len(appends))


def test_unzip_appends_of_a_decode_step() -> None:
    seqs = {f"s{i}": Seq(i * 3) for i in range(5)}
    got = native.unzip_appends(seqs, [("s4", 1, None), ("s0", 2, [7, 8])])
    assert got == (["s4", "s0"], [1, 2], [None, [7, 8]], (12).to_bytes(8, "little") + bytes(8), True)
    assert native.unzip_appends(seqs, [("s1", 1, None), ("s1", 1, None)])[4] is False  # type: ignore[index]
    assert native.unzip_appends(seqs, [("s1", 1, None), ("nope", 1, None)]) is None
    assert native.unzip_appends(seqs, []) == ([], [], [], b"", True)
