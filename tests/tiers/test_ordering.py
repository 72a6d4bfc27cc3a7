"""In process: the spill of an evicted page runs before the write of its new owner (the engine's FIFO),
also when both queue behind a busy worker; a restore whose tier read fails is all or nothing."""

import asyncio
import os
import threading
from typing import Any

import pytest
import torch

from service.config import Settings
from service.pool import PoolState
from service.tiers.disk import DiskTier
from tests.tiers.helpers import kv_of, prompt, spill_tier

SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=8, device="cpu", dtype="float32")


def make_state(tier: str, tmp_path: Any) -> PoolState:
    return PoolState(Settings(**SMALL, spill=tier, spill_bytes=32 * 2200, spill_path=str(tmp_path)))


async def write_prompt(state: PoolState, seq_id: str, i: int) -> list[int]:
    """Prompt i (4 pages) written and freed: its pages cached. Returns them."""
    tokens, (k, v) = prompt(i), kv_of(i, 16)
    state.sequences.create(seq_id, [*tokens, 7])
    seq, ext = state.sequences.append(seq_id, 16, tokens, data_written=True)
    await state.engine.submit(lambda: state.engine.write(k, v, torch.from_numpy(ext.slots)))
    pages = state.sequences.block_table(seq)
    state.sequences.free(seq_id)
    return pages


def pages_hold(state: PoolState, pages: list[int], i: int) -> bool:
    k, v = kv_of(i, 16)
    blocks = state.storage.blocks[torch.tensor(pages)]  # [4, 2, L, P, H, D]
    want_k = k.reshape(2, 4, 4, 2, 16).transpose(0, 1)  # [pages, L, P, H, D]
    want_v = v.reshape(2, 4, 4, 2, 16).transpose(0, 1)
    return torch.equal(blocks[:, 0], want_k) and torch.equal(blocks[:, 1], want_v)


async def evict_behind_a_busy_worker(state: PoolState) -> list[int]:
    """Sequence "b" takes all 8 pages, evicting the cached ones, and writes them, while the worker is
    held: the spill copies and the write queue up, in the order they were submitted."""
    gate = threading.Event()
    busy = state.engine.submit(gate.wait)  # not inline: every later job queues behind it
    tokens_b, (k, v) = list(range(5000, 5032)), kv_of(99, 32)
    seq, ext = state.sequences.append("b", 32, tokens_b, data_written=True)  # evicts: spills are submitted
    write = state.engine.submit(lambda: state.engine.write(k, v, torch.from_numpy(ext.slots)))
    gate.set()
    await busy
    await write
    for _ in range(50):  # the spill's completion reaches the loop through call_soon_threadsafe
        await asyncio.sleep(0.01)
    pages = state.sequences.block_table(seq)
    state.sequences.free("b")
    return pages


async def spill_prompt(state: PoolState) -> tuple[list[int], list[int]]:
    """Prompt 1 written and cached as "a", then evicted by "b" behind a busy worker (the spill copies
    queued before b's write). Returns (a's pages, b's pages)."""
    old = await write_prompt(state, "a", 1)
    state.sequences.create("b")
    return old, await evict_behind_a_busy_worker(state)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_then_overwritten_pages_spill_their_old_data(tier: str, tmp_path: Any) -> None:
    async def scenario() -> None:
        state = make_state(tier, tmp_path)
        try:
            old, taken = await spill_prompt(state)
            assert set(old) <= set(taken)  # the prompt's pages were evicted and overwritten by "b"
            assert len(spill_tier(state).index) == 4
            await state.cache.restore([*prompt(1), 7], "", "")
            seq = state.sequences.create("a2", [*prompt(1), 7])
            assert seq.cached_tokens == 16
            new = state.sequences.block_table(seq)
            assert pages_hold(state, new, 1)  # the OLD data came back
        finally:
            state.close()

    asyncio.run(scenario())


def test_a_failed_tier_read_restores_nothing(tmp_path: Any) -> None:
    async def scenario() -> None:
        state = make_state("disk", tmp_path)
        try:
            await spill_prompt(state)
            disk = spill_tier(state)
            assert isinstance(disk, DiskTier)
            slot = sorted(disk.index.slots().values())[2]  # the third page's slot: its header names another
            os.pwrite(disk.fd, b"\xff", slot * 64 + 10)
            a = state.allocator
            cached = {p: a.page_name(p) for p in a.cached_pages()}
            assert len(cached) == 8
            await state.cache.restore([*prompt(1), 7], "", "")
            # The fresh pages went back free, uncommitted; the four cached pages their allocation
            # evicted are not lost: they went down to the tier.
            assert (a.num_used, a.num_cached, a.num_free) == (0, 4, 4)
            evicted = [h for p, h in cached.items() if p not in a.cached_pages()]
            assert len(evicted) == 4 and all(h in disk.index for h in evicted)
            assert all(a.page_name(p) is None for p in range(8) if p not in a.cached_pages())
            assert disk.stats.errors == 1 and disk.stats.hits == 0
            assert state.sequences.create("a2", [*prompt(1), 7]).cached_tokens == 0
        finally:
            state.close()

    asyncio.run(scenario())


FORMATS = {
    "fp8": dict(dtype="float8_e4m3fn", quant_granularity=8),
    "mla": dict(mla=True, num_kv_heads=1, kv_lora_rank=8),
}


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_scales_and_mla_latents_come_back_bit_for_bit(tier: str, fmt: str, tmp_path: Any) -> None:
    async def scenario() -> None:
        s = Settings(**{**SMALL, **FORMATS[fmt]}, spill=tier, spill_bytes=32 * 2200, spill_path=str(tmp_path))
        state = PoolState(s)
        storage, seqs = state.storage, state.sequences
        try:
            tokens = prompt(1)
            heads = s.num_kv_heads
            g = torch.Generator().manual_seed(3)
            k = torch.randn(2, 16, heads, 16, generator=g)
            v = None if s.mla else torch.randn(2, 16, heads, 16, generator=g)
            seqs.create("a", [*tokens, 7])
            seq, ext = seqs.append("a", 16, tokens, data_written=True)
            await state.engine.submit(lambda: state.engine.write(k, v, torch.from_numpy(ext.slots)))
            old = seqs.block_table(seq)
            blocks = storage.blocks[torch.tensor(old)].clone()
            scales = None if storage.scales is None else storage.scales[torch.tensor(old)].clone()
            seqs.free("a")
            seqs.create("b")
            taken, ext = seqs.append("b", 32, list(range(5000, 5032)), data_written=True)
            kb, vb = torch.randn(2, 32, heads, 16), None if s.mla else torch.randn(2, 32, heads, 16)
            await state.engine.submit(lambda: state.engine.write(kb, vb, torch.from_numpy(ext.slots)))
            assert set(old) <= set(seqs.block_table(taken))  # overwritten by "b"
            assert not torch.equal(storage.blocks[torch.tensor(old)].view(torch.uint8), blocks.view(torch.uint8))
            seqs.free("b")
            await asyncio.sleep(0.05)
            await state.cache.restore([*tokens, 7], "", "")
            new = seqs.block_table(seqs.create("a2", [*tokens, 7]))
            assert len(new) == 4
            got = storage.blocks[torch.tensor(new)]
            assert torch.equal(got.view(torch.uint8), blocks.view(torch.uint8))
            if scales is not None:
                assert storage.scales is not None
                assert torch.equal(storage.scales[torch.tensor(new)], scales) and scales.abs().sum() > 0
        finally:
            state.close()

    asyncio.run(scenario())


def test_a_cancelled_restore_finishes_and_leaks_nothing(tmp_path: Any) -> None:
    async def scenario() -> None:
        state = make_state("disk", tmp_path)
        try:
            await spill_prompt(state)
            task = asyncio.get_running_loop().create_task(state.cache.restore([*prompt(1), 7], "", ""))
            for _ in range(3):  # into its copies
                await asyncio.sleep(0)
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):  # the shielded restore goes on
                await asyncio.sleep(0.01)
            a = state.allocator
            assert a.num_used == 0 and a.num_cached + a.num_free == 8
            seq = state.sequences.create("a2", [*prompt(1), 7])
            assert seq.cached_tokens == 16 and pages_hold(state, state.sequences.block_table(seq), 1)
        finally:
            state.close()

    asyncio.run(scenario())
