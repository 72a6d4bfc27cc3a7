"""The pool tensor: blocks[num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim].

Every pool tensor is shareable from the start. On the CPU it lives in a sealed memfd (Linux; its
descriptor goes to other processes over the server's Unix-domain socket, service/ipc/fd_socket.py), or,
where memfd is missing or KVPOOL_SHARED_MEMORY=posix_shm, in a POSIX shared-memory segment
`/dev/shm/kvpool-<instance>-<key>` that other processes open by name; on CUDA it is exported once as a
CUDA IPC handle. `ipc_description()` is what `GET /v1/ipc` serves.
"""

import uuid
import weakref
from typing import Any

import torch

from service.config import Settings
from service.ipc.cuda_ipc import check_exportable, export_cuda
from service.ipc.memfd import SealedFile, create_sealed, memfd_available
from service.ipc.shm import Segment, create_shared
from service.wire.dtypes import DTYPES, FP8_DTYPES, StoredDtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"KVPOOL_DEVICE={name} but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"KVPOOL_DEVICE={name} but only {torch.cuda.device_count()} GPUs are visible")
        if device.index is None:  # "cuda": the current GPU, named, since torch.cuda.set_device refuses no index
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def blocks_shape(settings: Settings) -> tuple[int, int, int, int, int, int]:
    s = settings
    return (s.num_pages + 1, 1 if s.mla else 2, s.num_layers, s.page_size, s.num_kv_heads, s.head_dim)


def scales_shape(settings: Settings) -> tuple[int, int, int, int, int, int] | None:
    """FP8 pools: scales[num_pages + 1, 2, L, P, H, head_dim // g], indexed by the same pages; else None."""
    s = settings
    if s.dtype not in FP8_DTYPES:
        return None
    return (s.num_pages + 1, 2, s.num_layers, s.page_size, s.num_kv_heads, s.head_dim // s.quant_granularity)


def allocate_shared(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Segment]:
    """A zero-filled CPU tensor in a new POSIX shared-memory segment `name`; the caller unlinks it."""
    return create_shared(name, shape, dtype)


def _unlink_all(segments: list[Segment]) -> None:
    for segment in segments:
        segment.unlink()


def _close_all(files: list[SealedFile]) -> None:
    for file in files:
        file.close()


def shared_memory_kind(setting: str) -> str:
    """KVPOOL_SHARED_MEMORY (auto | memfd | posix_shm) -> the kind of a CPU pool."""
    if setting == "posix_shm" or (setting == "auto" and not memfd_available()):
        return "posix_shm"
    if not memfd_available():
        raise RuntimeError("KVPOOL_SHARED_MEMORY=memfd but this system cannot create a sealed memfd")
    return "memfd"


class Storage:
    """Owns the pool tensors. Page `num_pages` (the null page) stays zero for the process's life."""

    def __init__(self, settings: Settings, instance_id: str | None = None) -> None:
        self.device = resolve_device(settings.device)
        self.dtype = DTYPES[settings.dtype].torch
        # 16 hex digits keep segment names within macOS's 31-character limit.
        self.name_prefix = f"kvpool-{(instance_id or uuid.uuid4().hex)[:16]}"
        self.kind = "cuda_ipc" if self.device.type == "cuda" else shared_memory_kind(settings.shared_memory)
        self.segments: list[Segment] = []
        self.files: list[SealedFile] = []  # memfd: their descriptors, in the order of self._exports
        # Unlinks on garbage collection and at interpreter exit: the backstop for close().
        self._finalizer = weakref.finalize(self, _unlink_all, self.segments)
        self._fd_finalizer = weakref.finalize(self, _close_all, self.files)
        self._exports: dict[str, dict[str, Any]] = {}
        if self.kind == "cuda_ipc":
            check_exportable()
        self.blocks = self.allocate("blocks", blocks_shape(settings), settings.dtype)
        self.mla, self.kv_lora_rank = settings.mla, settings.kv_lora_rank
        # FP8 pools: per-group scales, indexed by the same pages and exported beside the blocks
        # (unwritten slots keep scale 0).
        shape = scales_shape(settings)
        self.scales = None if shape is None else self.allocate("scales", shape, settings.scale_dtype)

    def allocate(self, key: str, shape: tuple[int, ...], dtype_name: StoredDtype) -> torch.Tensor:
        """A zero-filled pool tensor on the device, exported under `key` in ipc_description()."""
        dtype = DTYPES[dtype_name].torch
        if self.kind == "memfd":
            tensor, file = create_sealed(f"{self.name_prefix}-{key}", shape, dtype)
            handle: dict[str, Any] = {"fd_index": len(self.files), "offset": 0, "nbytes": file.nbytes}
            self.files.append(file)
        elif self.kind == "posix_shm":
            tensor, segment = allocate_shared(f"{self.name_prefix}-{key}", shape, dtype)
            self.segments.append(segment)
            handle = {"name": segment.name, "offset": 0, "nbytes": segment.nbytes}
        else:
            tensor = torch.zeros(shape, dtype=dtype, device=self.device)
            handle = export_cuda(tensor)
        self._exports[key] = {
            "dtype": dtype_name,
            "shape": list(tensor.shape),
            "strides": list(tensor.stride()),
            "handle": handle,
        }
        return tensor

    def ipc_description(self) -> dict[str, Any]:
        """{"kind", <key>: {"dtype", "shape", "strides" (elements), "handle"}} for every pool tensor."""
        return {"kind": self.kind, **self._exports}

    def shared_fds(self) -> tuple[list[int], list[str]]:
        """memfd pools: the descriptors other processes receive, and the pool tensors they hold."""
        keys = [key for key, spec in self._exports.items() if "fd_index" in spec["handle"]]
        return [file.fd for file in self.files], keys

    def close(self) -> None:
        """Unlink the shared segments, close the memfds (idempotent); the memory goes when the last mapping does."""
        _unlink_all(self.segments)
        _close_all(self.files)
