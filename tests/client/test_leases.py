"""The client against a real server with leases on (KVPOOL_DEFAULT_TTL_S): every sequence call returns
the lease fields, and nothing breaks on them (the client once raised TypeError on `ttl_s`)."""

import asyncio
from typing import Any

import pytest
import torch

from service.client import AsyncKVPoolClient, KVPoolClient, SequenceInfo
from service.core import errors
from tests.conftest import Server


def assert_leased(info: SequenceInfo, ttl_s: float) -> None:
    assert info.ttl_s == ttl_s
    assert info.expires_in_s is not None and ttl_s - 5 < info.expires_in_s <= ttl_s


def test_every_sequence_call_returns_the_lease(start_server: Any) -> None:
    server: Server = start_server({"KVPOOL_DEFAULT_TTL_S": "30"})
    torch.manual_seed(0)
    with KVPoolClient(server.url) as client:
        created = client.create_sequence("s1", token_ids=list(range(6)))
        assert (created.seq_id, created.length, created.block_table) == ("s1", 0, [])
        assert_leased(created, 30.0)
        assert_leased(client.get_sequence("s1"), 30.0)

        k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)
        appended = client.append("s1", token_ids=list(range(6)), k=k, v=v)
        assert appended.length == 6 and appended.block_table == [0, 1]
        assert appended.slots == [0, 1, 2, 3, 4, 5]
        assert_leased(appended, 30.0)

        child = client.fork("s1", "s1-child")
        assert (child.seq_id, child.length, child.block_table) == ("s1-child", 6, [0, 1])
        assert_leased(child, 30.0)  # a fork inherits its parent's lease

        own = client.create_sequence("s2", ttl_s=120)
        assert_leased(own, 120.0)
        unleased = client.create_sequence("s3", ttl_s=0)
        assert (unleased.ttl_s, unleased.expires_in_s) == (None, None)

        step = client.step([("s1", 1), ("s2", 2)], seq_ids=["s1", "s2", "s1-child"])
        assert step.input_lengths == [1, 2, 0] and step.cache_lengths.tolist() == [6, 0, 6]
        # s1 writes into the partial page it shares with its child: copy-on-write gives it page 2; s2 takes 3.
        assert step.slots == [[10], [12, 13], []]
        assert_leased(client.get_sequence("s1"), 30.0)

        assert client.free("s1-child") == 1  # page 1, its own since the copy; page 0 is still s1's
        assert client.free("s1") == 2
        assert [client.free(s) for s in ("s2", "s3")] == [1, 0]
        with pytest.raises(errors.SequenceNotFound):
            client.get_sequence("s1")


def test_the_async_client_with_leases(start_server: Any) -> None:
    server: Server = start_server({"KVPOOL_DEFAULT_TTL_S": "30"})

    async def scenario() -> None:
        async with AsyncKVPoolClient(server.url) as client:
            assert_leased(await client.create_sequence("a1"), 30.0)
            assert_leased(await client.append("a1", 3), 30.0)
            assert_leased(await client.fork("a1", "a1-child"), 30.0)
            assert_leased(await client.get_sequence("a1-child"), 30.0)
            assert (await client.step([("a1", 1)])).cache_lengths.tolist() == [3]
            assert await client.free("a1-child") == 1  # page 0: a1's step copied it before writing
            assert await client.free("a1") == 1

    asyncio.run(scenario())
