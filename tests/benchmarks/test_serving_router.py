"""benchmarks/serving/router.py: a node's cost for a prompt, as the prefix policies weigh it; the index's
queries over kept-alive connections, against a real uvicorn server that closes idle ones."""

import asyncio
from pathlib import Path

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from benchmarks.http_client import TransportError
from benchmarks.serving.fleet import router_service
from benchmarks.serving.router import IndexClient, computed, costs
from service.cli import free_port


def test_without_a_shared_tier_only_what_a_node_holds_is_not_computed() -> None:
    assert costs(computed(1000, [900, 0], shared_tier=False, restore_weight=0.1), [0, 0], [0, 0]) == [100, 1000]


def test_the_requests_in_flight_count_by_their_prompts() -> None:
    # The holder serves a 1,000-token prompt: the prompt goes to the idle node, which computes it all.
    assert costs(computed(1000, [900, 0], shared_tier=False, restore_weight=0.1), [0, 0], [1000, 0]) == [1100, 1000]
    assert costs(computed(1000, [900, 0], shared_tier=False, restore_weight=0.1), [0, 0], [800, 0]) == [900, 1000]


def test_the_requests_before_their_first_token_count_what_they_compute_as_well() -> None:
    # Each node serves a 600-token prompt; node 0's has not reached its first token and computes 500 of it:
    # a new prompt node 0 holds goes to node 1, which restores it (as Dynamo weighs prefill and decode blocks).
    assert costs(computed(600, [512, 0], shared_tier=True, restore_weight=0.1), [0, 0], [600, 600]) == [688, 739.2]
    assert costs(computed(600, [512, 0], shared_tier=True, restore_weight=0.1), [500, 0], [600, 600]) == [1188, 739.2]
    # Without a shared tier the holder's prefill is still cheaper than computing the whole prompt elsewhere.
    assert costs(computed(600, [512, 0], shared_tier=False, restore_weight=0.1), [500, 0], [600, 600]) == [1188, 1200]


def test_with_a_shared_tier_every_node_restores_what_any_node_holds() -> None:
    # Node 1 computes the same 100 tokens as node 0 and restores node 0's 900 at a tenth of their cost.
    assert computed(1000, [900, 0], shared_tier=True, restore_weight=0.1) == [100, 190]
    assert costs(computed(1000, [900, 0], shared_tier=True, restore_weight=0.1), [0, 0], [1000, 0]) == [1100, 190]
    assert computed(1000, [900, 600], shared_tier=True, restore_weight=0.5) == [100, 250]


def test_a_match_longer_than_the_prompt_counts_as_the_whole_prompt() -> None:
    assert computed(100, [160, 0], shared_tier=True, restore_weight=0.1) == [0, 10]
    assert computed(100, [160, 0], shared_tier=False, restore_weight=0.1) == [0, 100]


def test_a_true_option_is_passed_as_a_flag(tmp_path: Path) -> None:
    service = router_service(tmp_path, "r", ["http://a", "http://b"], "match", kvpools="k1,k2", shared_tier=True)
    assert service.cmd[-3:] == ["--kvpools", "k1,k2", "--shared-tier"]


def test_the_index_client_keeps_its_connections_and_replaces_those_the_server_closed() -> None:
    """uvicorn closes a kept-alive connection idle for timeout_keep_alive (5 s by default, here 0.3 s): the
    next query goes on a fresh connection instead of failing the request it routes."""
    port = free_port()
    seen: list[int] = []

    async def match(request: Request) -> JSONResponse:
        seen.append(len((await request.json())["token_ids"]))
        return JSONResponse({"cached_tokens": 16})

    app = Starlette(routes=[Route("/v1/prefix/match", match, methods=["POST"])])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, timeout_keep_alive=0.3, log_level="warning")

    async def scenario() -> None:
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        client, url = IndexClient(), f"http://127.0.0.1:{port}"
        try:
            asks = (client.post(url, "/v1/prefix/match", {"token_ids": [1] * n}) for n in (3, 5))
            answers = await asyncio.gather(*asks)
            assert [(status, orjson.loads(body)) for status, body in answers] == [(200, {"cached_tokens": 16})] * 2
            assert len(client.idle[url]) == 2  # one per query in flight, both kept
            status, _ = await client.post(url, "/v1/prefix/match", {"token_ids": [1]})
            assert status == 200 and len(client.idle[url]) == 2  # a kept one reused
            await asyncio.sleep(1.0)  # the server closes both
            status, _ = await client.post(url, "/v1/prefix/match", {"token_ids": [1, 2]})
            assert status == 200 and len(client.idle[url]) == 1  # both found closed, a fresh one used and kept
            assert sorted(seen) == [1, 2, 3, 5]  # each query answered once
        finally:
            server.should_exit = True
            await serving
        with pytest.raises(TransportError):  # nobody listening: a fresh connection's failure is the caller's
            await client.post(url, "/v1/prefix/match", {"token_ids": [1]})

    asyncio.run(scenario())
