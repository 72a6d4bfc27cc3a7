"""The remote tier (KVPOOL_REMOTE_URL) on this node: a background writer of committed pages, and lookups.

Written at commit, not at eviction: a prefix computed here is of use to the other nodes at once.
Writes: committed() queues newly computed pages here (bounded: a full queue skips and
counts). A task on the loop takes batches of about 8 MiB, keeps the pages still registered under
the same hash (evicted ones are no longer those pages), gathers them through the engine (after the
write that committed them, submitted first; on the loop when the engine is idle and the batch small) and
sends them from a thread (RemoteStore.put: over a connection of its own, each value from its gathered row).
Lookups (lookup()) count what the store holds on the loop, over asyncio streams (RemoteStore.count_on_loop:
a few hundred bytes each way, where a hop to a thread and back cost more than the round trip under load),
or on a cluster, or through redis-py, on the read thread (RemoteStore.count). Reads (load_into()) receive
the pages on the loop too over redis:// and unix:// (RemoteStore.get_into_on_loop: recv_into on a
non-blocking socket straight into the pages, waiting for the store without blocking the loop, each wait
bounded by the timeout), else on the read thread (RemoteStore.get_into: blocking recv_into straight into
the pages; TLS, a cluster, redis-py), so a slow store never blocks the loop. A failure is counted, logged
once per incident, and the tier is skipped for a second (Incident).
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from service.engine.engine import DeviceEngine
from service.tiers.pages import PageCodec
from service.tiers.remote import RemoteStore
from service.tiers.stats import Incident
from service.tiers.tier import Found, PromptChain

log = logging.getLogger("kvpool.tiers")
WRITE_BATCH_BYTES = 8 << 20  # per remote write (one gather, one pipelined round trip)


class RemoteTier:
    name = "remote"

    def __init__(
        self,
        store: RemoteStore,
        engine: DeviceEngine,
        codec: PageCodec,
        page_name: Callable[[int], bytes | None],
        queue: int,
    ) -> None:
        """`page_name`: the hash a device page is registered under now (the allocator's page_name)."""
        self.store, self.engine, self.codec, self.page_name = store, engine, codec, page_name
        self.stats = store.stats
        self.incident = Incident(self.name, log)
        self._queue: collections.deque[tuple[int, bytes, bytes]] = collections.deque()
        self._queue_max = queue
        self._batch = max(1, WRITE_BATCH_BYTES // codec.page_nbytes)
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._read = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-remote-read")
        self._write = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-remote-write")
        self._staging: np.ndarray | None = None  # read_into's host rows on a pool off the host
        self._staging_lock = asyncio.Lock()

    def report(self) -> dict[str, Any]:
        unknown = {"capacity_bytes": None, "used_bytes": None, "entries": None, "capacity_entries": None}
        row = {"tier": self.name, **dataclasses.asdict(self.stats), **unknown, "evictions": 0}
        return row | {"up": not self.incident.down, "queued_pages": len(self._queue)}

    # -- writes -----------------------------------------------------------------------------------
    def evicted(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        """(The store has what it was given at commit.)"""

    def committed(self, pages: np.ndarray, hashes: np.ndarray, token_bytes: bytes) -> None:
        """Newly computed pages (on the loop, inside the allocator's call): queue them, or skip them all."""
        try:  # (an exception would leave the allocator half-changed: none escapes)
            n = len(pages)
            if len(self._queue) + n > self._queue_max:
                self.stats.skipped += n
                return
            size = len(token_bytes) // n
            for i, page in enumerate(pages.tolist()):
                self._queue.append((page, hashes[i].tobytes(), token_bytes[i * size : (i + 1) * size]))
            self._wake.set()
            if self._writer is None:
                self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        except Exception as exc:  # no running loop (a tool driving the core)
            self.incident.failed(self.stats, exc)

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                if not self.incident.usable():
                    self.stats.skipped += len(batch)
                    continue
                # Pages evicted since their commit (and maybe rewritten) are no longer those pages.
                live = [b for b in batch if self.page_name(b[0]) == b[1]]
                if not live:
                    continue
                pages, hashes, tokens = [b[0] for b in live], [b[1] for b in live], [b[2] for b in live]
                try:
                    # (At once, on the loop, when the worker is idle and the batch small: no hop to it.)
                    small = self.engine.fits_inline(nbytes=len(pages) * self.codec.page_nbytes)
                    data = await self.engine.submit(functools.partial(self._gather, pages), inline=small)
                    sent = await loop.run_in_executor(self._write, self.store.put, hashes, tokens, data)
                except Exception as exc:  # the store down or slow: count, skip, go on
                    self.incident.failed(self.stats, exc)
                    continue
                self.incident.succeeded()
                self.stats.bytes_out += sent

    def _gather(self, pages: list[int]) -> np.ndarray:
        return self.codec.gather(pages).numpy()

    # -- lookups ----------------------------------------------------------------------------------
    def peek(self, chain: PromptChain, start: int, limit: int) -> int:
        """0: a round trip to the store per POST /v1/prefix/match, where the route costs microseconds."""
        return 0

    async def lookup(self, chain: PromptChain, start: int, limit: int) -> Found:
        """The pages start.. of `chain` the store holds, in order, up to `limit` in all ([] if the tier
        is failing): what a restore allocates pages for and then reads (load_into)."""
        if start >= limit or not self.incident.usable():
            return []

        def count() -> tuple[list[bytes], int]:  # (on the read thread: the chain's hashes and the round trips)
            hashes = chain.hashes(limit)[start:]
            return hashes, self.store.count(hashes)

        try:
            if self.store.counts_on_loop:  # one wake-up per round trip, where the read thread cost three
                hashes = chain.hashes(limit)[start:]
                num = await self.store.count_on_loop(hashes)
            else:  # a cluster, or reads through redis-py: blocking
                hashes, num = await asyncio.get_running_loop().run_in_executor(self._read, count)
        except Exception as exc:
            self.incident.failed(self.stats, exc)
            return []
        self.incident.succeeded()
        found = [(h, chain.tokens(start + i)) for i, h in enumerate(hashes[:num])]
        if not found:
            self.stats.misses += 1
        return found

    async def load_into(self, found: Found, pages: list[int]) -> int:
        """The entries `found` (by lookup) into `pages`, fresh uncommitted pool pages; returns how
        many, from the first, came in intact (0 if the read failed: counted). On a CPU pool each value
        is received straight into its page, once every job submitted before (their old owners' writes,
        the spills of what they held) has run; elsewhere into host rows, then one engine copy."""
        hashes, tokens = [h for h, _ in found[: len(pages)]], [t for _, t in found[: len(pages)]]
        pages = pages[: len(hashes)]
        try:
            if self.codec.on_host:
                await self.engine.submit(lambda: None, inline=True)  # (no hop when nothing is ahead)
                got = await self._get_into(hashes, tokens, [self.codec.host_views(p) for p in pages])
            else:
                async with self._staging_lock:  # (one restore at a time in the rows: read, then copied)
                    staging = self._staging_rows(len(pages))
                    got = await self._get_into(hashes, tokens, [[row.data] for row in staging])
                    if got:
                        rows = torch.from_numpy(staging[:got])
                        await self.engine.submit(lambda: self.codec.scatter(pages[:got], rows))
        except Exception as exc:
            self.incident.failed(self.stats, exc)
            return 0
        self.incident.succeeded()
        self.stats.hits += got
        self.stats.bytes_in += got * self.codec.page_nbytes
        return got

    async def _get_into(self, hashes: list[bytes], tokens: list[bytes], into: list[list[memoryview]]) -> int:
        """The page reads: on the loop (plain TCP or a unix socket: one wake-up per reply that is not
        there yet, where the read thread cost three hops), else on the read thread (TLS, a cluster,
        redis-py)."""
        if self.store.reads_on_loop:
            return await self.store.get_into_on_loop(hashes, tokens, into)
        return await asyncio.get_running_loop().run_in_executor(self._read, self.store.get_into, hashes, tokens, into)

    def _staging_rows(self, num: int) -> np.ndarray:
        """Host rows [num, page_nbytes] for a pool off the host, kept for the next restore (grown as
        needed; pinned on CUDA): first-touch faults of a fresh 64 MiB buffer would cost milliseconds."""
        if self._staging is None or len(self._staging) < num:
            pinned = self.codec.device.type == "cuda"
            self._staging = torch.empty((num, self.codec.page_nbytes), dtype=torch.uint8, pin_memory=pinned).numpy()
        return self._staging[:num]

    def stop(self) -> None:
        """No more writes (before the engine closes)."""
        if self._writer is not None:
            self._writer.cancel()

    def close(self) -> None:
        self._read.shutdown(wait=False)
        self._write.shutdown(wait=False)
        self.store.close()
