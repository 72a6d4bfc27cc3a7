"""Token ids as int64 bytes (service/core/token_ids.py): the compiled build against the same file run
as plain Python and against numpy."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from service.core import token_ids
from tests.core.conftest import load_source

source = load_source("token_ids")


@given(st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1, -(2**63)]))))
def test_int64_bytes_are_little_endian_int64(ids: list[int]) -> None:
    assert token_ids.int64_bytes(ids) == source.int64_bytes(ids) == np.array(ids, dtype="<i8").tobytes()


@pytest.mark.parametrize(
    ("ids", "error"), [([1, 2**63], OverflowError), ([-(2**63) - 1], OverflowError), ([1, 2.0], TypeError)]
)
def test_int64_bytes_rejects_what_does_not_fit(ids: list[object], error: type[Exception]) -> None:
    for convert in (token_ids.int64_bytes, source.int64_bytes):
        with pytest.raises(error):
            convert(ids)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12), st.integers(-1, 14), st.integers(-1, 14))
def test_int64_bytes_of_a_range_is_that_of_the_slice(ids: list[int], start: int, stop: int) -> None:
    expected = np.array(ids[max(start, 0) : len(ids) if stop < 0 else stop], dtype="<i8").tobytes()
    for convert in (token_ids.int64_bytes, source.int64_bytes):
        assert convert(ids, start, stop) == convert(tuple(ids), start, stop) == expected


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint64])
def test_int64_bytes_of_an_array_is_that_of_its_list(dtype: type) -> None:
    ids = [0, 1, 7, 100, 255]
    for convert in (token_ids.int64_bytes, source.int64_bytes):
        assert convert(np.array(ids, dtype=dtype), 1, 4) == convert(ids, 1, 4) == np.array(ids[1:4], "<i8").tobytes()
