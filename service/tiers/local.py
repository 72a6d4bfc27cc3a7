"""The node's second tier: host memory (pinned on a CUDA pool) or a file on a local disk.

Both keep a TierIndex (service/core/tier_index.py) of slots of one page each. Ordering (why a read
never sees the wrong data):
- Host: the slots are only read and written by engine jobs (spill: pool -> slots, restore: slots ->
  pool), and the engine runs jobs in submission order. The loop reserves a slot and submits its copy
  in one go; a restore that looked a slot up submits its read before any later reservation of that
  slot can submit an overwrite.
- Disk: the engine job gathers the pages into host memory and hands the write to the tier's one IO
  thread; an entry becomes visible to lookups only when its write has landed (ready()), and reads go
  to the same IO thread, so a read queued for a ready entry runs before any later overwrite of its
  slot. Each slot's header names its page, checked on every read. On a CPU pool a restore's read
  lands straight in its fresh pool pages from the IO thread (no staging copy): they are that restore's
  alone until it commits them, and it reads only after an engine barrier, so the spills of their old
  content have run (Tiers._read_disk).
"""

import logging
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from service.core.tier_index import TierIndex
from service.tiers.pages import PageCodec, paired_runs
from service.tiers.stats import Incident, TierStats

log = logging.getLogger("kvpool.tiers")

HEADER = struct.Struct("<8s32s")  # magic, the page's hash: which page a slot holds
MAGIC = b"kvpool1\x00"
HEADER_NBYTES = 64  # the header padded
IOV_MAX = 1024  # buffers per preadv (Linux's limit)


class TierDataError(Exception):
    """A tier returned data that is not the page asked for (its slot names another page)."""


class HostTier:
    name = "host"

    def __init__(self, codec: PageCodec, nbytes: int, pinned: bool) -> None:
        self.codec = codec
        # The KV events' medium: vLLM's "CPU", below a pool on any device (whose own events say "GPU").
        self.medium = "CPU"
        self.page_nbytes = codec.page_nbytes
        self.index = TierIndex(nbytes // self.page_nbytes)
        self.capacity_bytes = self.index.num_slots * self.page_nbytes
        self.store = torch.empty((self.index.num_slots, self.page_nbytes), dtype=torch.uint8, pin_memory=pinned)
        # On a CPU pool the copies go through numpy views (a microsecond a run); on CUDA through torch
        # (DMA from the pinned rows).
        self.rows: torch.Tensor | np.ndarray = self.store.numpy() if codec.device.type == "cpu" else self.store
        self.stats = TierStats()
        self.incident = Incident(self.name, log)

    def spill_job(self, pages: list[int], slots: list[int]) -> Callable[[], None]:
        """The engine job copying `pages` into `slots`: one copy per run consecutive on both sides."""

        def job() -> None:
            for _, first, slot, count in paired_runs(pages, slots):
                self.codec.read_run(first, count, self.rows[slot : slot + count])

        return job

    def read_job(self, slots: list[int], pages: list[int]) -> Callable[[], None]:
        def job() -> None:
            for _, slot, first, count in paired_runs(slots, pages):
                self.codec.write_run(first, count, self.rows[slot : slot + count])

        return job

    def close(self) -> None:
        pass


class DiskTier:
    """A file of num_slots headers (64 bytes each: magic, page hash), then num_slots pages of data, so
    that a run of slots is one contiguous read straight into a run of pool pages. A read checks each
    slot's header names the page asked for (identity); integrity is the file system's (no checksum
    pass over the data: on a CPU pool it would cost as much as the read itself)."""

    name = "disk"
    medium = "STORAGE"  # the KV events' medium: vLLM's for its file-system offloading tier

    def __init__(self, codec: PageCodec, nbytes: int, directory: str, instance_id: str) -> None:
        self.codec = codec
        self.page_nbytes = codec.page_nbytes
        self.record_nbytes = HEADER_NBYTES + self.page_nbytes
        self.index = TierIndex(nbytes // self.record_nbytes)
        self.capacity_bytes = self.index.num_slots * self.record_nbytes
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
        self.stats = TierStats()
        self.incident = Incident(self.name, log)

    def write(self, slots: list[int], hashes: list[bytes], data: np.ndarray) -> "Future[None]":
        """Queue the pages of `data` (uint8 [n, page_nbytes]) into `slots` on the IO thread."""
        return self.io.submit(self._write, slots, hashes, data)

    def _write(self, slots: list[int], hashes: list[bytes], data: np.ndarray) -> None:
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
        return self.io.submit(self._read, slots, hashes, dests)

    def _read(self, slots: list[int], hashes: list[bytes], dests: list[np.ndarray]) -> None:
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
