"""The one owner of device work on the pool: K/V writes, copy-on-write page copies, attention.

The core hands out slots and pages; every write into `blocks` and every attention call goes
through here, under one lock, so requests never race on the pool.
"""

import threading

import torch

from kernels.reference import paged_attention_ref, store_kv_ref
from service.engine_formats import format_pages
from service.storage import Storage


class Engine:
    def __init__(self, storage: Storage, backend: str = "auto") -> None:
        self.storage = storage
        self.blocks = storage.blocks
        self.device = storage.device
        self.backend = "torch" if backend == "auto" and self.device.type == "cpu" else backend
        if self.backend == "auto":
            self.backend = "triton"
        self.lock = threading.Lock()
        # FP8 (blocks + scales) and MLA (latent) pools: their own store/attention paths.
        self.formats = format_pages(storage, self.backend)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (all layers, K and V): the copy-on-write of shared partial pages."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        with self.lock:
            self.blocks[dst] = self.blocks[src]
            if self.formats is not None:
                self.formats.copy_pages(src, dst)

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None = None) -> None:
        """k, v: [L, T, H, D] (all layers) or [T, H, D] (one layer); slots: [T]. MLA: k only."""
        if self.formats is not None:
            k, slots = k.to(self.device), slots.to(self.device)
            with self.lock:
                self.formats.write(k, None if v is None else v.to(self.device), slots, layer)
            return
        assert v is not None
        k, v, slots = (t.to(self.device, non_blocking=True) for t in (k, v, slots))
        with self.lock:
            store_kv_ref(self.blocks, k, v, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D] in q's dtype."""
        dev = self.device
        q = q.to(dev)
        lut = lookup_table.to(dev)
        cache_lengths, query_start_loc = cache_lengths.to(dev), query_start_loc.to(dev)
        if self.formats is not None:
            with self.lock:
                return self.formats.attend(
                    q,
                    layer,
                    lut,
                    cache_lengths,
                    query_start_loc,
                    scale=scale,
                    sliding_window=sliding_window,
                    softcap=softcap,
                )
        with self.lock:
            out = paged_attention_ref(
                q,
                self.blocks,
                layer,
                lut,
                cache_lengths,
                query_start_loc,
                scale=scale,
                sliding_window=sliding_window,
                softcap=softcap,
            )
        assert isinstance(out, torch.Tensor)
        return out
