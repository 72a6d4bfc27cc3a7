"""One `Backend` protocol for the device work on a pool (write K/V, attend, copy pages), implemented for
each kind of pool, and the one place that picks the implementation.

  PlainPages  blocks [N+1, 2, L, P, H, D] in float32 / float16 / bfloat16
  Fp8Pages    float8_e4m3fn (or float8_e5m2) blocks + per-group scales [N+1, 2, L, P, H, D // g]: quantize on store
  MlaPages    blocks [N+1, 1, L, P, 1, D]: one latent per token; values are its first kv_lora_rank channels

Each runs the torch references (kernels/reference*.py) or the Triton kernels; a plain CPU pool may also
take "cpu", the references with a compiled decode for float32 batches (kernels/cpu_decode.py).
Backends receive tensors already on the pool's device and do no locking: DeviceEngine runs them on its one
device worker.

Triton kernel modules are imported only by a backend that runs them, after `select_backend` has set
TRITON_INTERPRET for a CPU pool: Triton reads it when @triton.jit decorates.
"""

import os
from typing import Literal, Protocol, Unpack, cast

import torch

from kernels.batched_reference import one_query_per_sequence, paged_attention_batched, store_kv_direct
from kernels.cpu_decode import paged_attention_cpu
from kernels.options import AttendOptions
from kernels.reference_fp8 import paged_attention_fp8_ref, store_kv_fp8_ref
from kernels.reference_mla import mla_attention_ref, store_latent_ref
from service.engine.storage import Storage

BackendName = Literal["triton", "cpu", "torch"]


class Backend(Protocol):
    name: BackendName

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None) -> None:
        """k, v: [L, T, H, D] (all layers, layer None) or [T, H, D] (one layer); slots: [T]. MLA: v is None."""

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **options: Unpack[AttendOptions],
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq, D] in q's dtype ([T, Hq, kv_lora_rank] for MLA)."""
        ...

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages src[i] -> dst[i] (int64 [n] each): everything the pool keeps per page."""


class PlainPages:
    def __init__(self, blocks: torch.Tensor, name: BackendName) -> None:
        self.blocks, self.name = blocks, name
        if name == "triton":
            from kernels import decode, prefill, store

            self._store, self._decode, self._prefill = store, decode, prefill

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None) -> None:
        assert v is not None
        if self.name == "triton":
            self._store.store_kv(self.blocks, k, v, slots, layer)
        else:
            store_kv_direct(self.blocks, k, v, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **options: Unpack[AttendOptions],
    ) -> torch.Tensor:
        args = (self.blocks, layer, lookup_table, cache_lengths)
        if self.name == "cpu":
            return paged_attention_cpu(q, *args, query_start_loc, **options)
        if self.name == "torch":
            return paged_attention_batched(q, *args, query_start_loc, **options)
        qd = q.to(self.blocks.dtype)  # the kernels take q in the pool's dtype
        if one_query_per_sequence(q, query_start_loc):  # a decode step
            out = self._decode.paged_decode(qd, *args, **options)
        else:
            out = self._prefill.paged_prefill(qd, *args, query_start_loc, **options)
        assert isinstance(out, torch.Tensor)
        return out.to(q.dtype)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.blocks[dst] = self.blocks[src]


class Fp8Pages:
    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, name: BackendName) -> None:
        self.blocks, self.scales, self.name = blocks, scales, name

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None) -> None:
        assert v is not None
        if self.name == "triton":
            from kernels.store_fp8 import store_kv_fp8

            store_kv_fp8(self.blocks, self.scales, k.contiguous(), v.contiguous(), slots, layer)
        else:
            store_kv_fp8_ref(self.blocks, self.scales, k, v, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **options: Unpack[AttendOptions],
    ) -> torch.Tensor:
        args = (self.blocks, self.scales, layer, lookup_table, cache_lengths, query_start_loc)
        if self.name == "triton":
            from kernels.attention_fp8 import paged_attention_fp8

            return paged_attention_fp8(q.contiguous(), *args, **options)
        return paged_attention_fp8_ref(q, *args, **options)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.blocks[dst] = self.blocks[src]
        self.scales[dst] = self.scales[src]


class MlaPages:
    def __init__(self, blocks: torch.Tensor, kv_lora_rank: int, name: BackendName) -> None:
        self.blocks, self.kv_lora_rank, self.name = blocks, kv_lora_rank, name

    def write(self, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor, layer: int | None) -> None:
        assert v is None
        if self.name == "triton":
            from kernels.mla import store_latent

            store_latent(self.blocks, k.contiguous(), slots, layer)
        else:
            store_latent_ref(self.blocks, k, slots, layer)

    def attend(
        self,
        q: torch.Tensor,
        layer: int,
        lookup_table: torch.Tensor,
        cache_lengths: torch.Tensor,
        query_start_loc: torch.Tensor,
        **options: Unpack[AttendOptions],
    ) -> torch.Tensor:
        args = (q.contiguous(), self.blocks, layer, lookup_table, cache_lengths, query_start_loc, self.kv_lora_rank)
        if self.name == "triton":
            from kernels.mla import mla_attention

            return mla_attention(*args, **options)
        return mla_attention_ref(*args, **options)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.blocks[dst] = self.blocks[src]


def select_backend(storage: Storage, setting: str) -> Backend:
    """The backend for `storage`'s pool. setting: auto | triton | cpu | torch (KVPOOL_ATTENTION_BACKEND).

    auto: triton on a GPU; on the CPU, cpu for a plain pool and torch for FP8 and MLA pools, whose CPU
    side is the torch reference (the compiled decode is for plain K/V pools). triton on a CPU pool runs
    the kernels in Triton's interpreter: slow, but the code path a GPU runs. FP8 and MLA pools have no
    compiled CPU path: there "cpu" runs their references, as "torch" does.
    """
    device = storage.device
    special = storage.scales is not None or storage.mla
    e5m2 = storage.dtype == torch.float8_e5m2  # the Triton FP8 kernels are e4m3's: its references run
    if setting == "auto":
        setting = "torch" if e5m2 else "triton" if device.type != "cpu" else "torch" if special else "cpu"
    if setting not in ("triton", "cpu", "torch"):
        raise ValueError(f"unknown attention backend {setting!r}: auto, triton, cpu or torch")
    if setting == "cpu" and device.type != "cpu":
        raise RuntimeError(f"attention backend 'cpu' runs on a CPU pool, not on {device}")
    name = cast(BackendName, setting)
    if name == "triton" and e5m2:
        raise RuntimeError("the Triton FP8 kernels store and read e4m3: an e5m2 pool runs attention backend 'torch'")
    if name == "triton" and device.type == "cpu":
        # CPU tensors can only run through the interpreter: set before any kernel module is imported.
        os.environ["TRITON_INTERPRET"] = "1"
    if storage.scales is not None:
        return Fp8Pages(storage.blocks, storage.scales, name)
    if storage.mla:
        return MlaPages(storage.blocks, storage.kv_lora_rank, name)
    return PlainPages(storage.blocks, name)
