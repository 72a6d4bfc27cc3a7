"""POST /v1/sequences `reserve_to`: a create that also appends the rest of its token ids (a vLLM connector's lookup
and the reservation of the prompt it will save, in one call), where pages allow."""

from tests.conftest import Server

TOKENS = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # three full pages of 4, then one token more


def cached_pages(server: Server, seq_id: str, tokens: list[int]) -> list[int]:
    """Leave `tokens` cached (appended with their ids, then freed: committed); their pages."""
    assert server.client.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201
    append = server.client.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": len(tokens), "token_ids": tokens})
    assert append.status_code == 200, append.text
    assert server.client.delete(f"/v1/sequences/{seq_id}").status_code == 200
    return list(append.json()["block_table"])


def test_a_create_reserves_the_rest_of_its_token_ids_beyond_the_cached_prefix(server: Server) -> None:
    pages = cached_pages(server, "writer", TOKENS[:4])
    made = server.client.post(
        "/v1/sequences?instance=true", json={"seq_id": "r", "token_ids": TOKENS, "reserve_to": 12}
    )
    assert made.status_code == 201, made.text
    body = made.json()
    assert (body["length"], body["cached_tokens"], len(body["block_table"])) == (12, 4, 3)
    assert body["block_table"][:1] == pages and body["instance_id"]
    pool = server.client.get("/v1/pool").json()
    assert (pool["pages_used"], pool["num_sequences"]) == (3, 1)
    # The reserved pages hold no K/V: nothing hits them until a call commits them (here the free).
    probe = server.client.post("/v1/prefix/match", json={"token_ids": TOKENS}).json()
    assert probe["cached_tokens"] == 4
    assert server.client.delete("/v1/sequences/r").status_code == 200
    assert server.client.post("/v1/prefix/match", json={"token_ids": TOKENS}).json()["cached_tokens"] == 12


def test_a_reservation_beyond_the_token_ids_is_refused_whole(server: Server) -> None:
    cached_pages(server, "writer", TOKENS[:4])
    before = server.client.get("/v1/pool").json()
    for body in (
        {"token_ids": TOKENS, "reserve_to": len(TOKENS) + 1},
        {"reserve_to": 4},
        {"token_ids": TOKENS, "reserve_to": -1},
    ):
        response = server.client.post("/v1/sequences", json=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "invalid_request" and response.json()["error"]["message"]
    assert server.client.get("/v1/pool").json() == before  # no sequence, no page touched
