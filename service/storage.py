"""The pool tensor: blocks[num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim]."""

import torch

from service.config import Settings

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"KVPOOL_DEVICE={name} but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"KVPOOL_DEVICE={name} but only {torch.cuda.device_count()} GPUs are visible")
    return device


def blocks_shape(settings: Settings) -> tuple[int, int, int, int, int, int]:
    s = settings
    return (s.num_pages + 1, 1 if s.mla else 2, s.num_layers, s.page_size, s.num_kv_heads, s.head_dim)


def scales_shape(settings: Settings) -> tuple[int, int, int, int, int, int] | None:
    """FP8 pools: scales[num_pages + 1, 2, L, P, H, head_dim // g], indexed by the same pages; else None."""
    s = settings
    if s.dtype != "float8_e4m3fn":
        return None
    return (s.num_pages + 1, 2, s.num_layers, s.page_size, s.num_kv_heads, s.head_dim // s.quant_granularity)


class Storage:
    """Owns the pool tensor. Page `num_pages` (the null page) stays zero for the process's life."""

    def __init__(self, settings: Settings) -> None:
        self.device = resolve_device(settings.device)
        self.dtype = DTYPES[settings.dtype]
        self.blocks = torch.zeros(blocks_shape(settings), dtype=self.dtype, device=self.device)
        # TODO(lead): route the scales through the shared (shm / CUDA IPC) allocation and export them
        # from /v1/ipc beside the blocks; zeros here (unwritten slots keep scale 0).
        self.mla, self.kv_lora_rank = settings.mla, settings.kv_lora_rank
        shape = scales_shape(settings)
        self.scales = (
            None if shape is None else torch.zeros(shape, dtype=DTYPES[settings.scale_dtype], device=self.device)
        )

    def close(self) -> None:
        """Release the pool (a no-op for memory the process allocator owns)."""
