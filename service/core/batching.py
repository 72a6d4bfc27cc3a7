"""The per-sequence loop at the start of a step: the appends split into columns, each sequence's row.

service/core/_batch.c runs it (setup.py builds it at install); unzip_appends_py below is its
definition, the fallback when it is not built, and the tests' oracle.
"""

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

Columns = tuple[list[str], list[int], list[Any], bytes, bool]


def unzip_appends_py(seqs: Mapping[str, Any], appends: list[Any]) -> Columns | None:
    """(ids, counts, token_lists, rows as native int64 bytes, whether the ids are distinct) of
    `appends`, a list of (seq_id, num_tokens, token_ids) tuples, with rows read from seqs[seq_id].row.
    None when an append is not such a tuple or an id is unknown: the caller's general path then
    raises the right error."""
    if any(type(a) is not tuple or len(a) != 3 for a in appends):
        return None
    ids, counts, token_lists = (list(c) for c in zip(*appends)) if appends else ([], [], [])
    if any(s not in seqs for s in ids):
        return None
    rows = [seqs[s].row for s in ids]
    if any(type(r) is not int or r < 0 for r in rows):
        return None
    return ids, counts, token_lists, np.array(rows, dtype=np.int64).tobytes(), len(set(ids)) == len(ids)


native: ModuleType | None
try:
    native = importlib.import_module("service.core._batch")
except ImportError:  # not built: the definition above does the work
    native = None

unzip_appends = unzip_appends_py if native is None else native.unzip_appends
