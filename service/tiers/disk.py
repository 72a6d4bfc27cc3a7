"""The spill tier on a local disk (KVPOOL_SPILL=disk): a file of slots, written and read by one IO thread.

The engine job gathers the evicted pages into host memory and hands the write to the IO thread; an
entry becomes visible to lookups only when its write has landed, and reads go to the same IO thread,
so a read queued for a ready entry runs before any later overwrite of its slot. Each slot's header
names its page, checked on every read. On a CPU pool a restore's read lands straight in its fresh pool
pages from the IO thread (no staging copy): they are that restore's alone until it commits them, and
it reads only after an engine barrier, so the spills of their old content have run.
"""

import asyncio
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from service.engine.engine import DeviceEngine
from service.tiers.pages import PageCodec, paired_runs
from service.tiers.spill import SpillTier, TierDataError, catching
from service.tiers.tier import TierEvents

HEADER = struct.Struct("<8s32s")  # magic, the page's hash: which page a slot holds
MAGIC = b"kvpool1\x00"
HEADER_NBYTES = 64  # the header padded
IOV_MAX = 1024  # buffers per preadv (Linux's limit)


class DiskTier(SpillTier):
    """A file of num_slots headers (64 bytes each: magic, page hash), then num_slots pages of data, so
    that a run of slots is one contiguous read straight into a run of pool pages. A read checks each
    slot's header names the page asked for (identity); integrity is the file system's (no checksum
    pass over the data: on a CPU pool it would cost as much as the read itself)."""

    name = "disk"
    medium = "STORAGE"  # the KV events' medium: vLLM's for its file-system offloading tier

    def __init__(
        self,
        codec: PageCodec,
        engine: DeviceEngine,
        nbytes: int,
        events: TierEvents | None,
        directory: str,
        instance_id: str,
    ) -> None:
        self.entry_nbytes = HEADER_NBYTES + codec.page_nbytes
        super().__init__(codec, engine, nbytes, events)
        self.data_offset = self.index.num_slots * HEADER_NBYTES
        if not os.path.isdir(directory):
            raise RuntimeError(f"KVPOOL_SPILL_PATH={directory!r} is not a directory")
        self.path = os.path.join(directory, f"kvpool-spill-{instance_id[:16]}.bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise RuntimeError(f"KVPOOL_SPILL_PATH={directory!r}: cannot create the spill file: {exc}") from None
        os.unlink(self.path)  # an anonymous file: gone with the process, whatever way it ends
        # Reads may land straight in the pool where it is host memory laid out as the file is (no scales).
        self.direct = codec.device.type == "cpu" and codec.scales is None
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-disk")

    def _copy_down(self, pages: list[int], slots: list[int], hashes: list[bytes]) -> None:
        loop = asyncio.get_running_loop()

        def job() -> None:  # on the engine: gather; the IO thread writes, then the loop hears of it
            data = self.codec.gather(pages).numpy()
            self.write(slots, hashes, data).add_done_callback(
                lambda f: loop.call_soon_threadsafe(self._landed, slots, hashes, f.exception())
            )

        def failed(f: "asyncio.Future[BaseException | None]") -> None:  # (the IO thread reports the rest)
            if f.result() is not None:
                self._landed(slots, hashes, f.result())

        inline = self.engine.fits_inline(nbytes=len(pages) * self.page_nbytes)
        self.engine.submit(catching(job), inline).add_done_callback(failed)

    async def _read(self, slots: list[int], hashes: list[bytes], pages: list[int]) -> None:
        """On a CPU pool straight into the pool (the pages are this restore's alone, uncommitted), once
        every job submitted before (the spills of their old content) has run; elsewhere through a host
        buffer and an engine copy."""
        if not self.direct:
            staging = np.empty((len(pages), self.page_nbytes), dtype=np.uint8)
            await asyncio.wrap_future(self.read(slots, hashes, list(staging)))
            await self.engine.submit(lambda: self.codec.scatter(pages, torch.from_numpy(staging)))
            return
        await self.engine.submit(lambda: None, inline=True)  # (no hop when nothing is ahead)
        await asyncio.wrap_future(self.read(slots, hashes, [self.codec.host_page(p) for p in pages]))

    def write(self, slots: list[int], hashes: list[bytes], data: np.ndarray) -> "Future[None]":
        """Queue the pages of `data` (uint8 [n, page_nbytes]) into `slots` on the IO thread."""
        return self.io.submit(self._write_slots, slots, hashes, data)

    def _write_slots(self, slots: list[int], hashes: list[bytes], data: np.ndarray) -> None:
        headers = np.zeros((len(slots), HEADER_NBYTES), dtype=np.uint8)
        for i, page_hash in enumerate(hashes):
            headers[i, : HEADER.size] = np.frombuffer(HEADER.pack(MAGIC, page_hash), dtype=np.uint8)
        for i, first, _, count in paired_runs(slots, slots):
            _pwrite_all(self.fd, data[i : i + count], self.data_offset + first * self.page_nbytes)
            _pwrite_all(self.fd, headers[i : i + count], first * HEADER_NBYTES)

    def read(self, slots: list[int], hashes: list[bytes], dests: list[np.ndarray]) -> "Future[None]":
        """Queue a read of `slots` (whose pages are `hashes`) into `dests` (one contiguous uint8 array of
        page_nbytes per slot, host memory: a staging buffer's rows, or the pool's own pages) on the IO
        thread: one preadv per run of consecutive slots, whatever the destinations; TierDataError if a
        slot holds another page."""
        return self.io.submit(self._read_slots, slots, hashes, dests)

    def _read_slots(self, slots: list[int], hashes: list[bytes], dests: list[np.ndarray]) -> None:
        for i, first, _, count in paired_runs(slots, slots):
            headers = os.pread(self.fd, count * HEADER_NBYTES, first * HEADER_NBYTES)
            for j in range(count):
                magic, stored = HEADER.unpack_from(headers, j * HEADER_NBYTES)
                if magic != MAGIC or stored != hashes[i + j]:
                    raise TierDataError(f"slot {first + j} does not hold the page asked for")
            offset = self.data_offset + first * self.page_nbytes
            for start in range(i, i + count, IOV_MAX):
                bufs = [memoryview(d.data) for d in dests[start : min(start + IOV_MAX, i + count)]]
                got = os.preadv(self.fd, bufs, offset + (start - i) * self.page_nbytes)
                if got != len(bufs) * self.page_nbytes:
                    raise TierDataError(f"short read at slot {first + start - i}")

    def close(self) -> None:
        self.io.shutdown(wait=True)
        os.close(self.fd)


def _pwrite_all(fd: int, rows: np.ndarray, offset: int) -> None:
    buf, done = memoryview(np.ascontiguousarray(rows).reshape(-1).data), 0
    while done < len(buf):  # pwrite may write less than asked
        written = os.pwrite(fd, buf[done:], offset + done)
        if written <= 0:
            raise OSError("pwrite wrote nothing")
        done += written
