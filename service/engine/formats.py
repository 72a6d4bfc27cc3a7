"""Device work for pools that are not plain K/V: FP8 pages with scales, MLA latent pages.

Engine delegates here (its `formats` attribute) when the pool is one of these; it keeps the lock.
Backend "torch" runs the references, "triton" the kernels.

The Triton kernel modules are imported inside the triton branches, not at module level: Engine
decides whether TRITON_INTERPRET is needed (a CPU pool) before any kernel module is imported,
since Triton reads it when @triton.jit decorates.
"""

import torch

from kernels.reference_fp8 import paged_attention_fp8_ref, store_kv_fp8_ref
from kernels.reference_mla import mla_attention_ref, store_latent_ref
from service.engine.storage import Storage


class Fp8Pages:
    """float8_e4m3fn blocks + scales: quantize on store, dequantize in attention."""

    def __init__(self, storage: Storage, backend: str) -> None:
        assert storage.scales is not None
        self.blocks, self.scales, self.backend = storage.blocks, storage.scales, backend

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.scales[dst] = self.scales[src]

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None) -> None:
        assert v is not None
        if self.backend == "triton":
            from kernels.store_fp8 import store_kv_fp8

            store_kv_fp8(self.blocks, self.scales, k.contiguous(), v.contiguous(), slots, layer)
        else:
            store_kv_fp8_ref(self.blocks, self.scales, k, v, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lut: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **kwargs: float | int | None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D]."""
        if self.backend == "triton":
            from kernels.attention_fp8 import paged_attention_fp8

            return paged_attention_fp8(
                q.contiguous(),
                self.blocks,
                self.scales,
                layer,
                lut,
                cache_lengths,
                query_start_loc,
                **kwargs,  # type: ignore[arg-type]
            )
        return paged_attention_fp8_ref(
            q, self.blocks, self.scales, layer, lut, cache_lengths, query_start_loc, **kwargs
        )


class MlaPages:
    """blocks [N+1, 1, L, P, 1, D]: one latent per token; values are its first kv_lora_rank channels."""

    def __init__(self, storage: Storage, backend: str, kv_lora_rank: int) -> None:
        self.blocks, self.backend, self.kv_lora_rank = storage.blocks, backend, kv_lora_rank

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Nothing beyond the blocks, which Engine copies."""

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None) -> None:
        assert v is None
        if self.backend == "triton":
            from kernels.mla import store_latent

            store_latent(self.blocks, k.contiguous(), slots, layer)
        else:
            store_latent_ref(self.blocks, k, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lut: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **kwargs: float | int | None,
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, kv_lora_rank]."""
        args = (q.contiguous(), self.blocks, layer, lut, cache_lengths, query_start_loc, self.kv_lora_rank)
        if self.backend == "triton":
            from kernels.mla import mla_attention

            return mla_attention(*args, **kwargs)  # type: ignore[arg-type]
        return mla_attention_ref(*args, **kwargs)  # type: ignore[arg-type]


def format_pages(storage: Storage, backend: str) -> Fp8Pages | MlaPages | None:
    """The device path for an FP8 or MLA pool; None for a plain K/V pool (Engine's own path)."""
    if storage.scales is not None:
        return Fp8Pages(storage, backend)
    if storage.mla:
        return MlaPages(storage, backend, storage.kv_lora_rank)
    return None
