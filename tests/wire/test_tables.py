"""The wire's tables of facts: error codes (and their copy for readers in docs/http-api.md), dtypes."""

import base64
import re
from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from service.config import Settings
from service.core import errors
from service.wire.dtypes import DTYPES, PoolDtype, ScaleDtype, StoredDtype, TensorDtype, dtype_name
from service.wire.errors import ERROR_CODES, error_from_envelope, status_of
from service.wire.tensors import decode, encode

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


def documented_error_table() -> list[tuple[str, int]]:
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", API_PAGE.read_text(), flags=re.MULTILINE)
    return [(code, int(status)) for code, status in rows]


def test_the_api_page_documents_exactly_the_wire_table_of_error_codes() -> None:
    assert documented_error_table() == [(code, row.status) for code, row in ERROR_CODES.items()]


def test_every_core_error_class_has_its_row() -> None:
    classes = {cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.KVPoolError)}
    typed = {row.error for row in ERROR_CODES.values() if row.error is not None}
    assert typed == classes - {errors.KVPoolError}
    assert all(row.error.code == code for code, row in ERROR_CODES.items() if row.error is not None)
    assert status_of("no_such_code") == 500 == status_of(errors.KVPoolError.code)


@pytest.mark.parametrize(
    ("exc", "details"),
    [
        (errors.OutOfPages(25, 14), {"needed": 25, "available": 14}),
        (errors.SequenceNotFound("s'1"), {"seq_id": "s'1"}),
        (errors.SequenceExists("dup"), {"seq_id": "dup"}),
        (errors.AttendTooLarge(2**22 + 1, 2**22), {"tokens": 2**22 + 1, "limit": 2**22}),
        (errors.QuotaExceeded("tenant 'a' holds 3 pages"), {}),
    ],
)
def test_an_error_travels_as_code_message_and_details(exc: errors.KVPoolError, details: dict[str, object]) -> None:
    assert exc.details == details
    back = error_from_envelope(status_of(exc.code), exc.code, exc.message, exc.details)
    assert type(back) is type(exc) and back.message == exc.message and back.details == details
    assert back.status == status_of(exc.code)  # type: ignore[attr-defined]


def test_fields_come_from_details_never_from_the_message() -> None:
    exc = error_from_envelope(
        507, "out_of_pages", "need 1 pages, only 0 can be freed up", {"needed": 7, "available": 3}
    )
    assert isinstance(exc, errors.OutOfPages) and (exc.needed, exc.available) == (7, 3)
    bare = error_from_envelope(404, "sequence_not_found", "sequence 'x' does not exist")
    assert isinstance(bare, errors.SequenceNotFound) and bare.seq_id is None  # an envelope without details
    unknown = error_from_envelope(418, "teapot", "short and stout", {"spout": 1})
    assert type(unknown) is errors.KVPoolError and (unknown.code, unknown.details) == ("teapot", {})


def test_every_dtype_name_is_in_the_table_once() -> None:
    for subset in (PoolDtype, ScaleDtype, StoredDtype, TensorDtype):
        assert set(get_args(subset)) <= set(DTYPES)
    assert set(DTYPES) == set(get_args(StoredDtype)) | set(get_args(TensorDtype))
    assert set(get_args(Settings.model_fields["dtype"].annotation)) == set(get_args(PoolDtype))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_a_dtype_row_agrees_with_torch_and_numpy(name: str) -> None:
    row = DTYPES[name]
    assert row.torch is getattr(torch, name) and dtype_name(row.torch) == name
    assert row.itemsize == row.torch.itemsize == row.wire.itemsize
    assert row.wire.byteorder in "<|"  # little-endian (or single bytes)


@pytest.mark.parametrize("name", sorted(get_args(TensorDtype)))
def test_the_codec_round_trips_every_tensor_dtype_bit_for_bit(name: str) -> None:
    rng = np.random.default_rng(len(name))
    raw = rng.integers(0, 256, 3 * 5 * DTYPES[name].itemsize, dtype=np.uint8)
    tensor = torch.from_numpy(raw).view(DTYPES[name].torch).reshape(3, 5)
    wire = encode(tensor)
    assert wire["dtype"] == name and wire["shape"] == [3, 5]
    assert np.frombuffer(base64.b64decode(wire["data"]), np.uint8).tolist() == raw.tolist()
    back = decode("t", wire["dtype"], wire["shape"], wire["data"])
    assert back.dtype == tensor.dtype and torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


def test_the_codec_refuses_dtypes_the_wire_does_not_carry() -> None:
    for dtype in (torch.float64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="cannot encode"):
            encode(torch.zeros(2, dtype=dtype))
