"""Token ids are unsigned 32-bit at the whole API's edge (routers read the events' token ids as u32):
one past it is refused with 422 in the error envelope, naming the field, and changes nothing."""

from typing import Any

import pytest

from tests.conftest import Server

U32_MAX = 2**32 - 1


def requests(ids: list[int]) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "create": ("/v1/sequences", {"seq_id": "n", "token_ids": ids}),
        "append": ("/v1/sequences/e/append", {"num_tokens": len(ids), "token_ids": ids}),
        "step": ("/v1/step", {"appends": [{"seq_id": "e", "num_tokens": len(ids), "token_ids": ids}]}),
        "prefix match": ("/v1/prefix/match", {"token_ids": ids}),
    }


@pytest.mark.parametrize("route", ["create", "append", "step", "prefix match"])
def test_token_ids_outside_u32_are_refused(server: Server, route: str) -> None:
    c = server.client
    assert c.post("/v1/sequences", json={"seq_id": "e"}).status_code == 201
    before = c.get("/v1/pool").json()
    for bad in (2**32, -1, 2**63):
        path, body = requests([7, bad, 9, 11])[route]
        r = c.post(path, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert set(r.json()) == {"error"} and error["code"] == "invalid_request"
        assert "token_ids" in error["message"] and ("4294967296" in error["message"] or bad < 0)
    assert c.get("/v1/pool").json() == before
    assert c.get("/v1/sequences/e").json()["length"] == 0
    path, body = requests([7, U32_MAX, 9, 11])[route]
    assert c.post(path, json=body).status_code in (200, 201)
