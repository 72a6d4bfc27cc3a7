"""The prefix index's probe hash (service/core/probe_hash.py): the compiled build is its source."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from service.core import probe_hash as ph
from tests.core.conftest import load_source

source = load_source("probe_hash")


@given(st.binary(min_size=32, max_size=32), st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40))
def test_probe_hash_compiled_is_the_source(parent: bytes, ids: list[int]) -> None:
    page = np.array(ids, dtype="<i8").tobytes()
    seed = ph.new_seed(32 + len(page))
    h = ph.probe_hash(seed, parent, page)
    assert h == source.probe_hash(seed, parent, page)
    assert h != ph.probe_hash(ph.new_seed(32 + len(page)), parent, page)  # (fails with odds 2**-64)
    with pytest.raises(ValueError):
        ph.probe_hash(seed[:-1], parent, page)
