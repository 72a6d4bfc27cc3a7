"""POST /v1/sequences `cache_salt`: prefix-cache pages are shared only within one salt (and one tenant)."""

from tests.conftest import Server

TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 19]  # two full pages of 4, then the last prompt token


def cache(server: Server, seq_id: str, salt: str | None) -> None:
    """Leave TOKENS[:8] cached under `salt`: append them (ids known), then free (the pages commit)."""
    body = {"seq_id": seq_id} | ({"cache_salt": salt} if salt is not None else {})
    assert server.client.post("/v1/sequences", json=body).status_code == 201
    append = server.client.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": 8, "token_ids": TOKENS[:8]})
    assert append.status_code == 200, append.text
    assert server.client.delete(f"/v1/sequences/{seq_id}").status_code == 200


def hit(server: Server, salt: str | None) -> tuple[int, list[int]]:
    body = {"token_ids": TOKENS} | ({"cache_salt": salt} if salt is not None else {})
    seq = server.client.post("/v1/sequences", json=body).json()
    server.client.delete(f"/v1/sequences/{seq['seq_id']}")
    return seq["cached_tokens"], seq["block_table"]


def test_salted_prefixes_are_shared_only_within_their_salt(server: Server) -> None:
    cache(server, "writer-a", "tenant-x/user-1")
    assert hit(server, "tenant-x/user-1") == (8, [0, 1])
    assert hit(server, "tenant-x/user-2")[0] == 0
    assert hit(server, None)[0] == 0
    assert hit(server, "")[0] == 0  # an empty salt is no salt: it misses salted pages
    cache(server, "writer-none", None)
    pool = server.client.get("/v1/pool").json()
    assert (pool["pages_used"], pool["pages_cached"]) == (0, 4)  # the same tokens cached twice, apart
    assert hit(server, None)[0] == 8 and hit(server, "")[0] == 8
    assert hit(server, "tenant-x/user-1")[0] == 8


def test_a_too_long_salt_is_refused(server: Server) -> None:
    response = server.client.post("/v1/sequences", json={"token_ids": TOKENS, "cache_salt": "s" * 1025})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"
    assert server.client.get("/v1/pool").json()["num_sequences"] == 0
