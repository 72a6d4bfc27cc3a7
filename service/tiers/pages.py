"""Whole pages as bytes: what every tier stores per page (K/V of all layers, then FP8 scales).

A page is blocks[page] ([2 | 1, L, P, H, D], contiguous: the pool is page-major) followed, on FP8
pools, by scales[page]. gather() and scatter() move a batch of pages in one indexed copy each way,
and run on the engine's worker (they touch the pool).
"""

import torch

from service.engine.storage import Storage


class PageCodec:
    def __init__(self, storage: Storage) -> None:
        self.blocks, self.scales = storage.blocks, storage.scales
        self.device = storage.device
        self.block_nbytes = self.blocks[0].numel() * self.blocks.element_size()
        self.scale_nbytes = 0 if self.scales is None else self.scales[0].numel() * self.scales.element_size()
        self.page_nbytes = self.block_nbytes + self.scale_nbytes

    def gather(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [n, page_nbytes] on the CPU (into `out` when given): one indexed read on the device,
        one transfer to the host."""
        ids = torch.tensor(pages, dtype=torch.int64, device=self.device)
        parts = [self.blocks[ids].view(torch.uint8).reshape(len(pages), -1)]
        if self.scales is not None:
            parts.append(self.scales[ids].view(torch.uint8).reshape(len(pages), -1))
        data = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if out is None:
            return data.cpu() if self.device.type != "cpu" else data
        out.copy_(data)
        return out

    def scatter(self, pages: list[int], data: torch.Tensor) -> None:
        """Write `data` (uint8 [n, page_nbytes], any device) into `pages`: one transfer, one indexed write."""
        n = len(pages)
        ids = torch.tensor(pages, dtype=torch.int64, device=self.device)
        data = data.to(self.device, non_blocking=False)
        blk = data[:, : self.block_nbytes].contiguous().view(self.blocks.dtype)
        self.blocks[ids] = blk.reshape(n, *self.blocks.shape[1:])
        if self.scales is not None:
            sc = data[:, self.block_nbytes :].contiguous().view(self.scales.dtype)
            self.scales[ids] = sc.reshape(n, *self.scales.shape[1:])
