"""In process, against a real redis-server: a remote restore receives each value straight into its
fresh pool page (its K/V, then its FP8 scales) and commits only the leading run that came in intact;
the store killed between the count and the read commits nothing from it and leaks no page."""

import asyncio
import time
from typing import Any

import pytest
import torch

from service.config import Settings
from service.core.hashing import root_hash, token_bytes
from service.core.tier_index import chain_hashes
from service.pool import PoolState
from service.tiers.entries import EntryFormat
from service.tiers.remote import COUNT_BATCH, RemoteStore
from tests.tiers.conftest import RedisServer
from tests.tiers.helpers import kv_of, prompt, remote_tier, spill_tier
from tests.tiers.test_ordering import FORMATS, SMALL, write_prompt


def make_state(redis_server: RedisServer, **extra: Any) -> PoolState:
    return PoolState(Settings(**{**SMALL, **extra}, remote_url=redis_server.url, remote_timeout_s=2.0))


async def written_then_evicted(state: PoolState, redis_server: RedisServer, write: Any = None) -> None:
    """Prompt 1's four pages committed, in the store, then out of the device (every page free)."""
    await (write or write_prompt(state, "a", 1))
    deadline = time.monotonic() + 20
    while redis_server.client().dbsize() < 4:
        assert time.monotonic() < deadline, "the remote writer did not write the prompt's pages"
        await asyncio.sleep(0.02)
    seqs = state.sequences
    seqs.create("fill")
    seqs.append("fill", state.allocator.num_available * SMALL["page_size"])  # no token ids: nothing cached
    seqs.free("fill")
    assert (state.allocator.num_cached, state.allocator.num_free) == (0, 8)


def test_a_poisoned_page_cuts_the_restore_there(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        state = make_state(redis_server)
        try:
            await written_then_evicted(state, redis_server)
            entries = remote_tier(state).store.entries
            hashes = chain_hashes(root_hash(""), token_bytes(prompt(1)), 4 * 8)
            wrong = entries.encode(hashes[2], token_bytes(prompt(2)[8:12]), bytes(1024))
            redis_server.client().set(entries.key(hashes[2]), wrong)  # page 2: another prompt's tokens
            await asyncio.sleep(0.3)
            sent = remote_tier(state).stats.bytes_out
            await state.cache.restore([*prompt(1), 7], "", "")
            a, stats = state.allocator, remote_tier(state).stats
            assert (a.num_used, a.num_cached, a.num_free) == (0, 2, 6)  # pages 0 and 1; the rest went back free
            assert stats.hits == 2 and stats.rejected == 1 and stats.errors == 0
            await asyncio.sleep(0.3)  # (time for the remote writer to send anything it was handed)
            assert stats.bytes_out == sent  # restored pages are not written back: the commit says they came back
            seq = state.sequences.create("a2", [*prompt(1), 7])
            assert seq.cached_tokens == 8
            k, v = kv_of(1, 16)
            got = state.storage.blocks[torch.tensor(state.sequences.block_table(seq))]  # [2, 2, L, P, H, D]
            assert torch.equal(got[:, 0], k[:, :8].reshape(2, 2, 4, 2, 16).transpose(0, 1))
            assert torch.equal(got[:, 1], v[:, :8].reshape(2, 2, 4, 2, 16).transpose(0, 1))
        finally:
            state.close()

    asyncio.run(scenario())


def test_the_store_killed_between_count_and_read_commits_nothing(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        state = make_state(redis_server)
        try:
            await written_then_evicted(state, redis_server)
            store = remote_tier(state).store
            read, read_on_loop = store.get_into, store.get_into_on_loop

            def killed_first(*args: Any) -> int:  # the store dies after answering EXISTS
                redis_server.stop()
                return read(*args)

            async def killed_first_on_loop(*args: Any) -> int:  # (the reads on the loop: redis://)
                redis_server.stop()
                return await read_on_loop(*args)

            store.get_into = killed_first  # type: ignore[method-assign,assignment]
            store.get_into_on_loop = killed_first_on_loop  # type: ignore[method-assign,assignment]
            await state.cache.restore([*prompt(1), 7], "", "")
            assert redis_server.proc is None  # (killed by one or the other)
            a = state.allocator
            assert (a.num_used, a.num_cached, a.num_free) == (0, 0, 8)  # as it was
            assert all(a.page_name(p) is None for p in range(8))
            assert store.stats.errors == 1 and store.stats.hits == 0
            assert remote_tier(state).incident.down
            assert state.sequences.create("a2", [*prompt(1), 7]).cached_tokens == 0
        finally:
            state.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("reader", ["resp", "redis-py"])
def test_count_is_the_leading_run_the_store_holds_across_batches(redis_server: RedisServer, reader: str) -> None:
    """count() asks in batches (COUNT_BATCH keys, then twice as many, ...) and stops at the first key the store
    lacks, wherever it falls: in the first batch, at its last key, or in the next one."""
    store = RemoteStore(redis_server.url, 2.0, 60, EntryFormat("L2.H2.D16.P4.float32"), 1024)
    if reader == "redis-py":
        store.reader = None
    hashes = [i.to_bytes(32, "big") for i in range(1, 2 * COUNT_BATCH + 40)]
    keys = [store.entries.key(h) for h in hashes]
    client = redis_server.client()
    try:
        for hole in (0, COUNT_BATCH - 1, COUNT_BATCH, COUNT_BATCH + 17, len(hashes)):
            client.flushall()
            client.mset({key: b"x" for i, key in enumerate(keys) if i != hole})
            assert store.count(hashes) == hole, hole
        assert store.count([]) == 0
    finally:
        store.close()


SECRET = "a9c3f1e07b2d4c58a9c3f1e07b2d4c58"


@pytest.mark.parametrize("secret", ["", SECRET], ids=["checksum", "sealed"])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_pages_come_back_whole_bit_for_bit_with_fp8_scales(redis_server: RedisServer, path: str, secret: str) -> None:
    """An FP8 page is two parts in the pool (K/V, scales): each value is received into both, or (staged:
    as on a CUDA pool) into host rows copied in by the engine. Sealed, the MAC of the two parts as received
    is the one made over the page in one piece when it was written."""

    async def scenario() -> None:
        state = make_state(redis_server, remote_secret=secret, **FORMATS["fp8"])
        storage, seqs = state.storage, state.sequences
        if path == "staged":
            remote_tier(state).codec._host_parts = None  # the pool's pages not addressable from the host
        try:
            tokens = prompt(1)
            g = torch.Generator().manual_seed(3)
            k, v = torch.randn(2, 16, 2, 16, generator=g), torch.randn(2, 16, 2, 16, generator=g)

            async def write() -> None:
                seqs.create("a", [*tokens, 7])
                seq, ext = seqs.append("a", 16, tokens, data_written=True)
                await state.engine.submit(lambda: state.engine.write(k, v, torch.from_numpy(ext.slots)))
                old = torch.tensor(seqs.block_table(seq))
                before.extend([storage.blocks[old].clone(), storage.scales[old].clone()])  # type: ignore[index]
                seqs.free("a")

            before: list[torch.Tensor] = []
            await written_then_evicted(state, redis_server, write())
            storage.blocks.zero_()
            storage.scales.zero_()  # type: ignore[union-attr]
            await state.cache.restore([*tokens, 7], "", "")
            seq = seqs.create("a2", [*tokens, 7])
            assert seq.cached_tokens == 16
            new = torch.tensor(seqs.block_table(seq))
            assert torch.equal(storage.blocks[new].view(torch.uint8), before[0].view(torch.uint8))
            assert torch.equal(storage.scales[new], before[1]) and before[1].abs().sum() > 0  # type: ignore[index]
        finally:
            state.close()

    asyncio.run(scenario())


async def evicted_through(state: PoolState, redis_server: RedisServer, reader: str) -> tuple[Any, Any, list[bytes]]:
    """Prompt 1 written to the store and evicted, to be read through `reader` (ours: "resp", or
    "redis-py"); returns the tier's store, its stats, and the prompt's page hashes."""
    store, stats = remote_tier(state).store, remote_tier(state).stats
    if reader == "redis-py":
        store.reader = None
    await written_then_evicted(state, redis_server)
    return store, stats, chain_hashes(root_hash(""), token_bytes(prompt(1)), 4 * 8)


BAD_ENTRIES = {
    "empty": lambda client, key, value: client.set(key, b""),
    "truncated": lambda client, key, value: client.set(key, value[: len(value) // 2]),
    "one byte short": lambda client, key, value: client.set(key, value[:-1]),
    "a list": lambda client, key, value: (client.delete(key), client.rpush(key, value)),  # GETEX: -WRONGTYPE
}


@pytest.mark.parametrize("reader", ["resp", "redis-py"])
@pytest.mark.parametrize("bad", BAD_ENTRIES)
def test_a_bad_entry_of_any_shape_is_rejected_and_the_pages_before_it_come_back(
    redis_server: RedisServer, bad: str, reader: str
) -> None:
    """Page 2 of 4 replaced by a bad entry: pages 0 and 1 come back, the bad one is counted as rejected
    (not as a failure of the store), and the tier stays up for the next restore."""

    async def scenario() -> None:
        state = make_state(redis_server)
        try:
            store, stats, hashes = await evicted_through(state, redis_server, reader)
            client, key = redis_server.client(), store.entries.key(hashes[2])
            BAD_ENTRIES[bad](client, key, client.get(key))
            await state.cache.restore([*prompt(1), 7], "", "")
            a = state.allocator
            assert (stats.hits, stats.rejected, stats.errors) == (2, 1, 0)
            assert (a.num_used, a.num_cached, a.num_free) == (0, 2, 6)
            assert not remote_tier(state).incident.down
            assert state.sequences.create("a2", [*prompt(1), 7]).cached_tokens == 8
            state.sequences.free("a2")
            client.delete(key)  # the entry gone: the next restore asks the store again and stops before it
            await state.cache.restore([*prompt(1), 7], "", "")
            assert (stats.hits, stats.rejected, stats.errors, stats.misses) == (2, 1, 0, 1)
        finally:
            state.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("reader", ["resp", "redis-py"])
def test_with_a_secret_only_entries_made_with_it_are_loaded(redis_server: RedisServer, reader: str) -> None:
    """KVPOOL_REMOTE_SECRET: page 1 forged in the store (other K/V with the checksum recomputed as the
    format says, or sealed with another secret) or changed under the tag the secret made is rejected,
    each time; page 0 comes back bit for bit."""
    from service.tiers.entries import Checksum, EntryFormat, KeyedMac

    async def scenario() -> None:
        state = make_state(redis_server, remote_secret=SECRET)
        try:
            store, stats, hashes = await evicted_through(state, redis_server, reader)
            client, entries = redis_server.client(), store.entries
            assert sorted(k.decode() for k in client.keys()) == sorted(entries.key(h) for h in hashes)
            assert entries.key(hashes[0]).startswith("kvpool:v3m:")  # not where unsealed entries go
            toks = [token_bytes(prompt(1)[j * 4 : (j + 1) * 4]) for j in range(4)]
            forged = torch.randn(256, generator=torch.Generator().manual_seed(9)).numpy().tobytes()
            plain = EntryFormat(entries.geometry, Checksum())  # the attacker's: the format, no secret
            wrong_secret = EntryFormat(entries.geometry, KeyedMac(b"not the secret, 32 bytes long..."))
            sealed = bytearray(client.get(entries.key(hashes[3])))  # type: ignore[arg-type]
            sealed[-40] ^= 1  # a byte of the page, under the tag the secret made
            resalted = bytearray(client.get(entries.key(hashes[1])))  # type: ignore[arg-type]
            resalted[entries.header_nbytes(hashes[1], toks[1]) - 1] ^= 1  # its salt: the header is in the key
            attempts = [
                plain.encode(hashes[1], toks[1], forged),
                wrong_secret.encode(hashes[1], toks[1], forged),
                bytes(sealed),
                bytes(resalted),
            ]
            rejected = 0
            for attempt in attempts:
                client.set(entries.key(hashes[1]), attempt)
                await state.cache.restore([*prompt(1), 7], "", "")
                rejected += 1
                assert (stats.rejected, stats.errors) == (rejected, 0)
                seq = state.sequences.create("a2", [*prompt(1), 7])
                assert seq.cached_tokens == 4  # page 0 only
                k, v = kv_of(1, 16)
                got = state.storage.blocks[torch.tensor(state.sequences.block_table(seq))]  # [1, 2, L, P, H, D]
                assert torch.equal(got[0, 0], k[:, :4]) and torch.equal(got[0, 1], v[:, :4])
                state.sequences.free("a2")
        finally:
            state.close()

    asyncio.run(scenario())


def test_a_restore_continues_from_the_spill_tier_into_the_remote_one(redis_server: RedisServer) -> None:
    """Both tiers on, asked in order: the spill tier holds pages 0 and 1 of the prompt, the store all
    four; the restore loads 0 and 1 from the spill tier, asks the store for 2 and 3 only, and the pages
    come back bit for bit, committed as one chain."""

    async def scenario() -> None:
        state = make_state(redis_server, spill="host", spill_bytes=32 * 2200)
        try:
            assert [tier.name for tier in state.cache.tiers] == ["host", "remote"]
            spill, remote = spill_tier(state), remote_tier(state)
            await written_then_evicted(state, redis_server)
            await state.engine.submit(lambda: None)
            await asyncio.sleep(0.05)  # (the spill copies landed)
            hashes = chain_hashes(root_hash(""), token_bytes(prompt(1)), 4 * 8)
            assert all(spill.index.entry(h) is not None for h in hashes)
            assert spill.index.discard(hashes[2]) and spill.index.discard(hashes[3])
            await state.cache.restore([*prompt(1), 7], "", "")
            assert (spill.stats.hits, remote.stats.hits, remote.stats.misses) == (2, 2, 0)
            seq = state.sequences.create("a2", [*prompt(1), 7])
            assert seq.cached_tokens == 16
            k, v = kv_of(1, 16)
            got = state.storage.blocks[torch.tensor(state.sequences.block_table(seq))]  # [4, 2, L, P, H, D]
            assert torch.equal(got[:, 0], k.reshape(2, 4, 4, 2, 16).transpose(0, 1))
            assert torch.equal(got[:, 1], v.reshape(2, 4, 4, 2, 16).transpose(0, 1))
        finally:
            state.close()

    asyncio.run(scenario())
