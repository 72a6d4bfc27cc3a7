"""Random workloads on a tiny pool with a real spill tier (in process, the real engine and copies):
every page is in exactly one place per tier, the counts add up, every page the device or the tier
holds carries the K/V of its own prefix, and a restore whose read fails restores nothing. The KV
events (device and tier) build an index equal to what the device and the tier hold, and what
POST /v1/prefix/match counts (PrefixCache.match: the device's hits, then the tiers' peeks) is what the create gets.

A page's K/V is a function of its chained hash (its whole prefix), as a model's would be, so a page
restored from the wrong slot, or spilled after being overwritten, shows up as wrong data.
"""

import asyncio
import os
import tempfile
from typing import Any

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from service.config import Settings
from service.core.hashing import root_hash, token_bytes
from service.core.tier_index import chain_hashes
from service.events.listener import EventListener, EventMaker
from service.events.wire import BlockRemoved, BlockStored
from service.pool import PoolState
from service.tiers.disk import DiskTier
from service.tiers.spill import HostTier
from tests.tiers.helpers import spill_tier

PAGE, PAGES, SLOTS = 2, 6, 5
GEOMETRY = dict(num_layers=1, num_kv_heads=1, head_dim=4, page_size=PAGE, num_pages=PAGES, device="cpu")
ROOT = root_hash("")
# Prompts that share prefixes and come back: six of them fill three times the device pool.
prompts = st.one_of(
    st.sampled_from(
        [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5, 6, 7], [0, 1, 9], [3, 3, 3, 3, 3], [5, 4, 3, 2, 1, 0, 1], [7] * 7]
    ),
    st.lists(st.integers(0, 2), min_size=1, max_size=7),
)


def page_kv(page_hash: bytes) -> torch.Tensor:
    """[2, L, P, H, D]: the K/V a page with this prefix holds."""
    g = torch.Generator().manual_seed(int.from_bytes(page_hash[:7], "little"))
    return torch.randn(2, 1, PAGE, 1, 4, generator=g)


def failing() -> None:
    raise OSError("injected read failure")


class TierMachine(RuleBasedStateMachine):
    tier = "host"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        nbytes = SLOTS * ((64 if self.tier == "disk" else 0) + 2 * PAGE * 4 * 4)  # (disk records: a header)
        s = Settings(**GEOMETRY, spill=self.tier, spill_bytes=nbytes, spill_path=self.dir.name)
        self.loop = asyncio.new_event_loop()
        self.state = self.loop.run_until_complete(self._make(s))
        self.local = spill_tier(self.state)
        self.held: list[str] = []
        self.count = 0
        # KV events as PoolState wires them: the device's listener first, then the tier's.
        self.events: list[Any] = []
        self.state.allocator.listeners.insert(0, EventListener(self.events.append))
        self.local.events = EventListener(self.events.append)
        self.make = EventMaker(PAGE, "GPU", "bytes")
        self.seen: dict[str, set[Any]] = {"GPU": set(), self.local.medium: set()}

    @staticmethod
    async def _make(s: Settings) -> PoolState:
        return PoolState(s)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def settle(self) -> None:
        await self.state.engine.submit(lambda: None)  # every job submitted so far ran
        for _ in range(3):
            await asyncio.sleep(0.002)  # and its completion reached the loop
        if isinstance(self.local, DiskTier):
            await asyncio.wrap_future(self.local.io.submit(lambda: None))
            await asyncio.sleep(0.002)

    async def prompt(self, tokens: list[int], hold: bool, fail: bool) -> None:
        st_, cache = self.state, self.state.cache
        device_hits = len(st_.sequences.prefixes.match(tokens, "")[0]) if len(tokens) > 0 else 0
        local = self.local
        local.incident.retry_at = 0.0  # no back-off between rules
        if fail:  # the tier's next read fails: on the engine (host) or on the IO thread (disk)
            if isinstance(local, HostTier):

                async def fail_on_the_engine(*args: Any) -> None:
                    await st_.engine.submit(failing)

                local._read = fail_on_the_engine  # type: ignore[method-assign]
            else:
                assert isinstance(local, DiskTier)
                local.read = lambda *args: local.io.submit(failing)  # type: ignore[method-assign]
        used_before = st_.allocator.num_used
        expected = sum(cache.match(tokens, "", ""))  # what POST /v1/prefix/match says
        evictions = local.index.num_evictions
        await cache.restore(tokens, "", "")
        if fail:
            vars(local).pop("_read", None)
            vars(local).pop("read", None)
            assert st_.allocator.num_used == used_before  # the fresh pages went back
        self.count += 1
        seq_id = f"s{self.count}"
        seq = st_.sequences.create(seq_id, tokens)
        if fail:
            assert seq.cached_tokens <= device_hits * PAGE
        elif local.index.num_evictions == evictions:
            assert seq.cached_tokens == expected * PAGE
        else:  # the restore's own allocation spilled pages that pushed matched entries out of the tier
            assert seq.cached_tokens <= expected * PAGE
        cached = seq.cached_tokens
        todo = len(tokens) - cached
        if todo:
            try:
                seq, ext = st_.sequences.append(seq_id, todo, tokens[cached:], data_written=True)
            except Exception:
                st_.sequences.free(seq_id)
                return
            kv = self.kv_of(tokens)[:, :, cached:]
            await st_.engine.submit(lambda: st_.engine.write(kv[0], kv[1], torch.from_numpy(ext.slots)))
        if hold:
            self.held.append(seq_id)
        else:
            st_.sequences.free(seq_id)
        await self.settle()

    def kv_of(self, tokens: list[int]) -> torch.Tensor:
        """[2, L, T, H, D] of the prompt: full pages from their hashes, the tail zeros."""
        hashes = chain_hashes(ROOT, token_bytes(tokens), PAGE * 8)
        parts = [page_kv(h) for h in hashes]
        tail = len(tokens) - len(hashes) * PAGE
        parts.append(torch.zeros(2, 1, tail, 1, 4))
        return torch.cat(parts, dim=2)

    @rule(tokens=prompts, hold=st.booleans(), fail=st.sampled_from([False, False, False, True]))
    def run_prompt(self, tokens: list[int], hold: bool, fail: bool) -> None:
        self.run(self.prompt(tokens, hold and len(self.held) < 2, fail))

    @rule()
    def free_held(self) -> None:
        if self.held:
            self.state.sequences.free(self.held.pop(0))

    @invariant()
    def counts_add_up(self) -> None:
        a = self.state.allocator
        assert a.num_used + a.num_cached + a.num_free == PAGES
        assert a.num_used == len(
            {p for s in self.held for p in self.state.sequences.block_table(self.state.sequences.get(s))}
        )
        self.local.index.check()
        assert len(self.local.index) + self.local.index.num_free == SLOTS

    @invariant()
    def events_tell_what_the_device_and_the_tier_hold(self) -> None:
        for item in self.events:
            made = self.make(item)
            for e in made if isinstance(made, list) else [made]:
                if isinstance(e, BlockStored):
                    self.seen[e.medium] |= set(e.block_hashes)
                else:
                    assert isinstance(e, BlockRemoved)
                    assert set(e.block_hashes) <= self.seen[e.medium]  # only what it told of
                    self.seen[e.medium] -= set(e.block_hashes)
        self.events.clear()
        a, index = self.state.allocator, self.local.index
        assert self.seen["GPU"] == {a.page_name(p) for p in range(PAGES)} - {None}
        ready = {h for h in index.slots() if not index.entry(h).pending}  # type: ignore[union-attr]
        assert self.seen[self.local.medium] == ready

    @invariant()
    def every_page_holds_its_prefix(self) -> None:
        a, blocks = self.state.allocator, self.state.storage.blocks
        for p in range(PAGES):
            h = a.page_name(p)
            if h is not None:
                assert torch.equal(blocks[p], page_kv(h)), f"device page {p}"
        for h, slot in self.local.index.slots().items():
            entry = self.local.index.entry(h)
            assert entry is not None
            if entry.pending:
                continue
            if isinstance(self.local, HostTier):
                raw = self.local.store[slot]
            else:
                local = self.local
                assert isinstance(local, DiskTier)
                rec = os.pread(local.fd, local.page_nbytes, local.data_offset + slot * local.page_nbytes)
                raw = torch.from_numpy(np.frombuffer(rec, dtype=np.uint8).copy())
            assert torch.equal(raw.view(torch.float32).reshape(page_kv(h).shape), page_kv(h)), f"slot {slot}"

    def teardown(self) -> None:
        self.state.close()
        self.loop.close()
        self.dir.cleanup()


class DiskTierMachine(TierMachine):
    tier = "disk"


SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
TierMachine.TestCase.settings = SETTINGS
DiskTierMachine.TestCase.settings = SETTINGS
TestHostTier = TierMachine.TestCase
TestDiskTier = DiskTierMachine.TestCase
