"""CUDA IPC memory handles of pool tensors, through torch's own storage sharing.

Handles carry the GPU's UUID, never its index: indices differ between processes that see
different CUDA_VISIBLE_DEVICES. Memory from the allocator's `expandable_segments` cannot be
exported as a legacy IPC handle, so such a configuration is refused at start.
"""

import base64
import os
from typing import Any

import torch


def expandable_segments_enabled() -> bool:
    """Whether PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) turns on expandable_segments."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in os.environ.get(var, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def check_exportable() -> None:
    if expandable_segments_enabled():
        raise RuntimeError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, whose memory cannot be exported "
            "with CUDA IPC handles; unset it (or set expandable_segments:False) to serve the pool"
        )


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """The local index of the GPU with this UUID (as this process's CUDA_VISIBLE_DEVICES numbers it)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


def export_cuda(tensor: torch.Tensor) -> dict[str, Any]:
    """A JSON-able IPC handle of `tensor`'s storage (export once: the pool outlives every client)."""
    try:
        (
            _device,
            handle,
            size_bytes,
            offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = tensor.untyped_storage()._share_cuda_()
    except RuntimeError as exc:
        raise RuntimeError(f"the pool's CUDA memory cannot be exported as an IPC handle: {exc}") from exc
    assert tensor.device.index is not None
    return {
        "device_uuid": device_uuid(tensor.device.index),
        "storage_handle": _b64(handle),
        "storage_size_bytes": size_bytes,
        "storage_offset_bytes": offset_bytes,
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": ref_counter_offset,
        "event_handle": _b64(event_handle),
        "event_sync_required": event_sync_required,
        "tensor_offset": tensor.storage_offset(),
    }


def open_cuda(handle: dict[str, Any], dtype: torch.dtype, shape: list[int], strides: list[int]) -> torch.Tensor:
    """Open an exported handle in this process: a tensor on the same physical GPU memory."""
    index = device_index(handle["device_uuid"])
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        _unb64(handle["storage_handle"]),
        handle["storage_size_bytes"],
        handle["storage_offset_bytes"],
        _unb64(handle["ref_counter_handle"]),
        handle["ref_counter_offset"],
        _unb64(handle["event_handle"]),
        handle["event_sync_required"],
    )
    out = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    out.set_(storage, handle["tensor_offset"], shape, strides)
    return out
