"""Whole pages as bytes: what every tier stores per page (K/V of all layers, then FP8 scales).

A page is blocks[page] ([2 | 1, L, P, H, D], contiguous: the pool is page-major) followed, on FP8
pools, by scales[page]. Pages move in runs: consecutive pages are one contiguous slice of the pool,
so a run of pages that lands in (or comes from) consecutive rows of a tier is one copy each way.
These touch the pool: they run on the engine's worker.
"""

import numpy as np
import torch

from service.engine.storage import Storage


def paired_runs(a: list[int], b: list[int]) -> list[tuple[int, int, int, int]]:
    """(index, a[index], b[index], count) for each stretch where a and b both go up by one."""
    out: list[tuple[int, int, int, int]] = []
    for i, (x, y) in enumerate(zip(a, b)):
        if out:
            start, x0, y0, n = out[-1]
            if x == x0 + n and y == y0 + n:
                out[-1] = (start, x0, y0, n + 1)
                continue
        out.append((i, x, y, 1))
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. Between the GPU and pinned host memory the copy is queued without waiting (a restore of
    permuted pages is one copy per page: waiting for each held the first GPU run's restores to a quarter of
    the pinned copy's bandwidth); whoever reads the host side calls PageCodec.settle() first."""
    dst.copy_(src, non_blocking=dst.is_pinned() or src.is_pinned())


class PageCodec:
    def __init__(self, storage: Storage) -> None:
        self.blocks, self.scales = storage.blocks, storage.scales
        self.device = storage.device
        self.block_nbytes = self.blocks[0].numel() * self.blocks.element_size()
        self.scale_nbytes = 0 if self.scales is None else self.scales[0].numel() * self.scales.element_size()
        self.page_nbytes = self.block_nbytes + self.scale_nbytes

        # On a CPU pool, numpy views of the same memory ([N + 1, nbytes] uint8): a copy of one page costs
        # a memcpy and about a microsecond, where the same copy through torch's views costs ~40 µs.
        self._host_parts: list[np.ndarray] | None = None
        if self.device.type == "cpu":
            self._host_parts = [t.view(torch.uint8).view(t.shape[0], -1).numpy() for t in self._tensors()]

    @property
    def on_host(self) -> bool:
        return self._host_parts is not None

    def host_views(self, page: int) -> list[memoryview]:
        """The bytes of `page` in place, its K/V then its scales (CPU pools): where a read lands directly."""
        assert self._host_parts is not None
        return [part[page].data for part in self._host_parts]

    def host_page(self, page: int) -> np.ndarray:
        """The bytes of `page` in place (uint8 [page_nbytes]): CPU pools without FP8 scales only."""
        assert self._host_parts is not None and len(self._host_parts) == 1
        return self._host_parts[0][page]

    def _tensors(self) -> list[torch.Tensor]:
        return [self.blocks] if self.scales is None else [self.blocks, self.scales]

    def _parts(self, first: int, count: int) -> list[torch.Tensor]:
        """uint8 views [count, nbytes] of pages first..first+count-1: the blocks, then the scales."""
        return [t[first : first + count].view(torch.uint8).view(count, -1) for t in self._tensors()]

    def read_run(self, first: int, count: int, out: torch.Tensor | np.ndarray) -> None:
        """Pages first.. (count of them) into `out` (uint8 [count, page_nbytes], any device): one copy."""
        offset = 0
        if self._host_parts is not None and (isinstance(out, np.ndarray) or out.device.type == "cpu"):
            rows = out if isinstance(out, np.ndarray) else out.numpy()
            for part in self._host_parts:
                np.copyto(rows[:, offset : offset + part.shape[1]], part[first : first + count])
                offset += part.shape[1]
            return
        assert isinstance(out, torch.Tensor)
        for tensor in self._parts(first, count):
            _copy(out[:, offset : offset + tensor.shape[1]], tensor)
            offset += tensor.shape[1]

    def write_run(self, first: int, count: int, src: torch.Tensor | np.ndarray) -> None:
        """`src` (uint8 [count, page_nbytes], any device) into pages first..: one copy."""
        offset = 0
        if self._host_parts is not None and (isinstance(src, np.ndarray) or src.device.type == "cpu"):
            rows = src if isinstance(src, np.ndarray) else src.numpy()
            for part in self._host_parts:
                np.copyto(part[first : first + count], rows[:, offset : offset + part.shape[1]])
                offset += part.shape[1]
            return
        assert isinstance(src, torch.Tensor)
        for tensor in self._parts(first, count):
            _copy(tensor, src[:, offset : offset + tensor.shape[1]])
            offset += tensor.shape[1]

    def settle(self) -> None:
        """Wait for the copies queued so far (read_run/write_run with pinned host rows do not wait each)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def gather(self, pages: list[int]) -> torch.Tensor:
        """uint8 [n, page_nbytes] on the host: one copy per run of consecutive pages."""
        out = torch.empty((len(pages), self.page_nbytes), dtype=torch.uint8)
        for i, first, _, count in paired_runs(pages, pages):
            self.read_run(first, count, out[i : i + count])  # (into pageable memory: each copy waits)
        return out

    def scatter(self, pages: list[int], data: torch.Tensor) -> None:
        """`data` (uint8 [n, page_nbytes]) into `pages`: one copy per run of consecutive pages."""
        for i, first, _, count in paired_runs(pages, pages):
            self.write_run(first, count, data[i : i + count])
        self.settle()
