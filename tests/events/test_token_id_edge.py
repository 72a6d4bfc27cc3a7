"""Token ids are unsigned 32-bit at the whole API's edge (routers read the events' token ids as u32):
one past it is refused with 422 in the error envelope, naming the field, and changes nothing."""

from typing import Any

from tests.conftest import Server

U32_MAX = 2**32 - 1


def requests(ids: list[int]) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "create": ("/v1/sequences", {"seq_id": "n", "token_ids": ids}),
        "append": ("/v1/sequences/e/append", {"num_tokens": len(ids), "token_ids": ids}),
        "step": ("/v1/step", {"appends": [{"seq_id": "e", "num_tokens": len(ids), "token_ids": ids}]}),
        "prefix match": ("/v1/prefix/match", {"token_ids": ids}),
    }


def test_token_ids_outside_u32_are_refused(server: Server) -> None:
    c = server.client
    assert c.post("/v1/sequences", json={"seq_id": "e"}).status_code == 201
    for route in ("create", "append", "step", "prefix match"):
        before = c.get("/v1/pool").json(), c.get("/v1/sequences/e").json()
        for bad in (2**32, -1, 2**63):
            path, body = requests([7, bad, 9, 11])[route]
            r = c.post(path, json=body)
            assert r.status_code == 422, (route, r.text)
            error = r.json()["error"]
            assert set(r.json()) == {"error"} and error["code"] == "invalid_request"
            assert "token_ids" in error["message"] and ("4294967296" in error["message"] or bad < 0)
        assert (c.get("/v1/pool").json(), c.get("/v1/sequences/e").json()) == before
        path, body = requests([7, U32_MAX, 9, 11])[route]
        assert c.post(path, json=body).status_code in (200, 201), route
