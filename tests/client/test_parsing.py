"""The client's parsing of answers: fields a newer server adds never break it; errors keep their envelope."""

from typing import Any

import httpx
import orjson
import pytest
import torch

from service.client import SequenceInfo
from service.client.calls import Calls, check_response
from service.core import errors
from service.wire.tensors import encode_array

SEQUENCE = {"seq_id": "s1", "length": 5, "block_table": [3, 1], "cached_tokens": 4}
NEWER = {"priority": 2, "tier": {"name": "host", "pages": [7]}}  # fields this client has never heard of


def body(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj)


def test_sequence_answers_with_unknown_fields_parse() -> None:
    for call in (Calls.create_sequence("s1", None, None), Calls.get_sequence("s1"), Calls.fork("s0", "s1")):
        info = call.parse(body({**SEQUENCE, "ttl_s": 30.0, "expires_in_s": 29.5, **NEWER}))
        assert info == SequenceInfo(**SEQUENCE, ttl_s=30.0, expires_in_s=29.5)
        assert not hasattr(info, "priority")
    appended = Calls.append("s1", 2, None, None, None).parse(body({**SEQUENCE, "slots": [13, 14], **NEWER}))
    assert (appended.slots, appended.block_table, appended.ttl_s) == ([13, 14], [3, 1], None)
    assert Calls.free("s1").parse(body({"seq_id": "s1", "freed_pages": 2, **NEWER})) == 2


def test_a_step_answer_with_unknown_fields_parses() -> None:
    lut = torch.tensor([[3, 1, 16, 16]], dtype=torch.uint32)
    answer = {
        "lookup_table": {**encode_array(lut.numpy(), "uint32"), **NEWER},  # inside a tensor too
        "cache_lengths": encode_array(torch.tensor([5], dtype=torch.uint32).numpy(), "uint32"),
        "input_lengths": [1],
        "max_prompt_length": 1,
        "max_cache_length": 5,
        "sentinel": 16,
        "slots": [[6]],
        "format": "max",
        **NEWER,
    }
    step = Calls.step([("s1", 1)], None).parse(body(answer))
    assert torch.equal(step.lookup_table, lut) and step.cache_lengths.tolist() == [5]
    assert (step.input_lengths, step.max_prompt_length, step.max_cache_length, step.sentinel, step.slots) == (
        [1],
        1,
        5,
        16,
        [[6]],
    )


def test_an_attend_answer_with_unknown_fields_in_its_tensor_parses() -> None:
    out = torch.randn(2, 4, 16)
    answer = {"out": {**encode_array(out.numpy(), "float32"), "device": "cpu", **NEWER}, **NEWER}
    parsed = Calls.attend(0, ["s1"], torch.randn(2, 4, 16), [2], None, None, None, None, None).parse(body(answer))
    assert torch.equal(parsed, out)


def response(status: int, content: bytes) -> httpx.Response:
    return httpx.Response(status, content=content, request=httpx.Request("GET", "http://kvpool/v1/x"))


def test_an_error_envelope_with_unknown_fields_keeps_its_type_and_details() -> None:
    envelope = {"error": {"code": "out_of_pages", "message": "full", "details": {"needed": 9, "available": 2}, **NEWER}}
    with pytest.raises(errors.OutOfPages) as oop:
        check_response(response(507, body({**envelope, "trace_id": "abc"})))
    assert (oop.value.needed, oop.value.available, oop.value.message) == (9, 2, "full")


def test_an_answer_that_is_not_the_envelope_keeps_its_status() -> None:
    with pytest.raises(errors.KVPoolError) as bad_gateway:
        check_response(response(502, b"<html>bad gateway</html>"))
    assert (bad_gateway.value.code, bad_gateway.value.message) == ("http_502", "<html>bad gateway</html>")
    assert bad_gateway.value.status == 502  # type: ignore[attr-defined]
