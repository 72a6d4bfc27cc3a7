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
  slot. Each record carries the page's hash and a CRC-32 of its data, checked on every read.
"""

import logging
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from service.core.tier_index import TierIndex
from service.tiers.pages import PageCodec
from service.tiers.stats import Incident, TierStats

log = logging.getLogger("kvpool.tiers")

HEADER = struct.Struct("<8s32sI")  # magic, page hash, CRC-32 of the page's bytes
MAGIC = b"kvpool1\x00"
HEADER_NBYTES = 64  # the header padded: records stay 64-byte aligned


class TierDataError(Exception):
    """A tier returned data that is not the page asked for (wrong hash or checksum)."""


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start index, first slot, count) of each run of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot:
            start, first, count = out[-1]
            out[-1] = (start, first, count + 1)
        else:
            out.append((i, slot, 1))
    return out


class HostTier:
    name = "host"

    def __init__(self, codec: PageCodec, nbytes: int, pinned: bool) -> None:
        self.codec = codec
        self.page_nbytes = codec.page_nbytes
        self.index = TierIndex(nbytes // self.page_nbytes)
        self.capacity_bytes = self.index.num_slots * self.page_nbytes
        self.store = torch.empty((self.index.num_slots, self.page_nbytes), dtype=torch.uint8, pin_memory=pinned)
        self.stats = TierStats()
        self.incident = Incident(self.name, log)

    def spill_job(self, pages: list[int], slots: list[int]) -> Callable[[], None]:
        """The engine job copying `pages` into `slots` (one indexed gather; one copy per run of slots)."""

        def job() -> None:
            data = self.codec.gather(pages)
            for start, first, count in runs(slots):
                self.store[first : first + count].copy_(data[start : start + count])

        return job

    def read_job(self, slots: list[int], pages: list[int]) -> Callable[[], None]:
        def job() -> None:
            ids = torch.tensor(slots, dtype=torch.int64)
            self.codec.scatter(pages, self.store[ids])

        return job

    def close(self) -> None:
        pass


class DiskTier:
    name = "disk"

    def __init__(self, codec: PageCodec, nbytes: int, directory: str, instance_id: str) -> None:
        self.codec = codec
        self.page_nbytes = codec.page_nbytes
        self.record_nbytes = HEADER_NBYTES + self.page_nbytes
        self.index = TierIndex(nbytes // self.record_nbytes)
        self.capacity_bytes = self.index.num_slots * self.record_nbytes
        if not os.path.isdir(directory):
            raise RuntimeError(f"KVPOOL_SPILL_PATH={directory!r} is not a directory")
        self.path = os.path.join(directory, f"kvpool-spill-{instance_id[:16]}.bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise RuntimeError(f"KVPOOL_SPILL_PATH={directory!r}: cannot create the spill file: {exc}") from None
        os.unlink(self.path)  # an anonymous file: gone with the process, whatever way it ends
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-disk")
        self.stats = TierStats()
        self.incident = Incident(self.name, log)

    def write(self, slots: list[int], hashes: list[bytes], data: np.ndarray) -> "Future[None]":
        """Queue the records of `data` (uint8 [n, page_nbytes]) into `slots` on the IO thread."""
        return self.io.submit(self._write, slots, hashes, data)

    def _write(self, slots: list[int], hashes: list[bytes], data: np.ndarray) -> None:
        records = np.zeros((len(slots), self.record_nbytes), dtype=np.uint8)
        records[:, HEADER_NBYTES:] = data
        for i, page_hash in enumerate(hashes):
            header = HEADER.pack(MAGIC, page_hash, zlib.crc32(data[i]))
            records[i, : HEADER.size] = np.frombuffer(header, dtype=np.uint8)
        for start, first, count in runs(slots):
            buf = records[start : start + count].data
            offset, done = first * self.record_nbytes, 0
            while done < len(buf):  # pwrite may write less than asked
                written = os.pwrite(self.fd, buf[done:], offset + done)
                if written <= 0:
                    raise OSError("pwrite wrote nothing")
                done += written

    def read(self, slots: list[int], hashes: list[bytes]) -> "Future[np.ndarray]":
        """Queue a read of `slots` (whose pages are `hashes`) on the IO thread: uint8 [n, page_nbytes]."""
        return self.io.submit(self._read, slots, hashes)

    def _read(self, slots: list[int], hashes: list[bytes]) -> np.ndarray:
        records = np.empty((len(slots), self.record_nbytes), dtype=np.uint8)
        for start, first, count in runs(slots):
            nbytes = count * self.record_nbytes
            view = memoryview(records[start : start + count].reshape(-1).data)
            done = 0
            while done < nbytes:
                got = os.preadv(self.fd, [view[done:]], first * self.record_nbytes + done)
                if got <= 0:
                    raise TierDataError(f"short read at slot {first}")
                done += got
        data = records[:, HEADER_NBYTES:]
        for i, page_hash in enumerate(hashes):
            magic, stored_hash, crc = HEADER.unpack(records[i, : HEADER.size].tobytes())
            if magic != MAGIC or stored_hash != page_hash or crc != zlib.crc32(data[i]):
                raise TierDataError(f"slot {slots[i]} does not hold the page asked for")
        return data

    def close(self) -> None:
        self.io.shutdown(wait=True)
        os.close(self.fd)
