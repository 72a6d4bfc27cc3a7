"""The pool mapped into a client process: a torch view of `blocks` and K/V writes at served slots.

From `GET /v1/ipc`'s description: a memfd pool's descriptors are asked for on the server's Unix socket
(with the client's API key), a posix_shm pool's segment is opened by name, a CUDA pool's handle is opened.
"""

import os
from collections.abc import Sequence
from typing import Any

import torch

from service.core.errors import KVPoolError
from service.ipc.cuda_ipc import open_cuda
from service.ipc.fd_socket import receive_fds
from service.ipc.memfd import map_sealed
from service.ipc.shm import open_shared
from service.wire.dtypes import DTYPES


class PoolLost(KVPoolError):
    """The server answering now is not the one whose pool this process mapped (it restarted)."""

    code = "pool_lost"


def open_tensor(kind: str, spec: dict[str, Any], fds: Sequence[int] = ()) -> torch.Tensor:
    """A view of one exported pool tensor, from its entry in GET /v1/ipc (memfd: and the received `fds`)."""
    dtype = DTYPES[spec["dtype"]].torch
    handle = spec["handle"]
    if kind == "memfd":
        fd = fds[handle["fd_index"]]
        return map_sealed(fd, handle["offset"], handle["nbytes"], dtype, spec["shape"], spec["strides"])
    if kind == "posix_shm":
        return open_shared(handle["name"], handle["offset"], handle["nbytes"], dtype, spec["shape"], spec["strides"])
    if kind == "cuda_ipc":
        return open_cuda(handle, dtype, spec["shape"], spec["strides"])
    raise ValueError(f"unknown IPC kind {kind!r}")


def _flat_slots(slots: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots.reshape(-1).to(torch.int64)
    flat: list[int] = []
    for s in slots:
        if isinstance(s, int):
            flat.append(s)
        else:
            flat.extend(s)
    return torch.tensor(flat, dtype=torch.int64)


def receive_pool_fds(description: dict[str, Any], api_key: str | None) -> list[int]:
    """memfd pools: the descriptors, from the socket GET /v1/ipc names (401/403 as that route)."""
    answer, fds = receive_fds(description["socket"], api_key)
    if answer["instance_id"] != description["instance_id"]:
        for fd in fds:
            os.close(fd)
        raise PoolLost(f"the socket serves pool {answer['instance_id']}, not {description['instance_id']}")
    return fds


STORE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what kernels.store writes (not FP8 bytes)


class AttachedPool:
    """blocks: [num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim], shared with the server.

    `api_key`: memfd pools only, the key the server's socket checks (that of the HTTP client).
    """

    def __init__(self, description: dict[str, Any], api_key: str | None = None) -> None:
        self.kind: str = description["kind"]
        self.instance_id: str = description["instance_id"]
        self.description = description
        fds = receive_pool_fds(description, api_key) if self.kind == "memfd" else []
        try:
            self.blocks: torch.Tensor = open_tensor(self.kind, description["blocks"], fds)
            # FP8 pools: the per-group scales [num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim // g].
            scales = description.get("scales")
            self.scales: torch.Tensor | None = None if scales is None else open_tensor(self.kind, scales, fds)
        finally:
            for fd in fds:  # the mapping keeps the memory
                os.close(fd)
        self.num_pages = self.blocks.shape[0] - 1
        self.page_size = self.blocks.shape[3]

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def _device_slots(self, slots: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        """The slots, flat, checked against the pool (ValueError before anything is written), on its device."""
        flat = _flat_slots(slots)
        low, high = torch.aminmax(flat) if flat.numel() else (flat.new_zeros(()), flat.new_zeros(()))
        low_i, high_i = int(low), int(high)  # one read back, where the slots are on the GPU already
        limit = self.num_pages * self.page_size
        if low_i < 0 or high_i >= limit:
            raise ValueError(f"slot {low_i if low_i < 0 else high_i} is outside the pool's {limit} writable slots")
        return flat.to(self.device)

    def _pages_offsets(self, slots: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = self._device_slots(slots)
        return flat // self.page_size, flat % self.page_size

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
        layer: int | None = None,
    ) -> None:
        """Write K/V at `slots` (as append/step return them; a step's per-sequence lists may be nested).

        k, v: [num_layers, T, num_kv_heads, head_dim] (every layer) or [T, num_kv_heads, head_dim] (`layer`).
        """
        flat = self._device_slots(slots)
        geometry = list(self.blocks.shape[4:])
        expected = [len(flat), *geometry] if layer is not None else [self.blocks.shape[2], len(flat), *geometry]
        for name, t in (("k", k), ("v", v)):
            if list(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, not {list(t.shape)}")
        k, v = k.to(self.device, self.blocks.dtype), v.to(self.device, self.blocks.dtype)
        if self.device.type == "cuda" and self.blocks.dtype in STORE_DTYPES:
            # kvpool's store kernel: one pass over K/V (index_put_ on the 6-d pool moved K/V at a tenth of
            # the copy bandwidth on the first GPU run).
            from kernels.store import store_kv

            store_kv(self.blocks, k, v, flat, layer)
        else:
            pages, offsets = flat // self.page_size, flat % self.page_size
            if layer is None:  # blocks[pages, 0, :, offsets]: [T, L, H, D]
                self.blocks[pages, 0, :, offsets] = k.transpose(0, 1)
                self.blocks[pages, 1, :, offsets] = v.transpose(0, 1)
            else:
                self.blocks[pages, 0, layer, offsets] = k
                self.blocks[pages, 1, layer, offsets] = v
        if self.device.type == "cuda":
            # The server reads on its own stream in another process: the data must be there first.
            torch.cuda.synchronize(self.device)

    def read(
        self, slots: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor, layer: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at `slots`: [num_layers, T, H, D], or [T, H, D] for one `layer` (copies)."""
        pages, offsets = self._pages_offsets(slots)
        if layer is None:
            kv = self.blocks[pages, :, :, offsets]  # [T, 2, L, H, D]
            return kv[:, 0].transpose(0, 1).clone(), kv[:, 1].transpose(0, 1).clone()
        kv = self.blocks[pages, :, layer, offsets]  # [T, 2, H, D]
        return kv[:, 0].clone(), kv[:, 1].clone()

    def check(self, instance_id: str) -> None:
        """Raise PoolLost unless `instance_id` (as the server reports it now) is the mapped pool's."""
        if instance_id != self.instance_id:
            raise PoolLost(
                f"the server's pool is {instance_id}, this process mapped {self.instance_id}: "
                "the server restarted and the mapped memory is no longer its pool"
            )

    def close(self) -> None:
        """Drop this object's views; a mapping is released once no tensor views it any more."""
        self.blocks, self.scales = torch.empty(0), None

    def __enter__(self) -> "AttachedPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
