"""Argument checks shared by the kernel wrappers: a clear ValueError before anything launches."""

from dataclasses import dataclass

import torch

from kernels.options import AttendOptions, attend_options
from service.core.layout import pages_in_pool

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_blocks(blocks: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(num_pages, num_layers, page_size, num_kv_heads, head_dim) of a pool [N + 1, 2, L, P, H, D]."""
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 6 or blocks.shape[1] != 2:
        shape = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(
            f"blocks must be [num_pages + 1, 2, num_layers, page_size, num_kv_heads, head_dim], not {shape}"
        )
    if blocks.dtype not in FLOAT_DTYPES:
        raise ValueError(f"blocks must be float32, float16 or bfloat16, not {blocks.dtype}")
    if blocks.shape[0] < 2 or min(blocks.shape[2:]) < 1:
        raise ValueError(f"blocks {tuple(blocks.shape)} holds no page besides the null page")
    if blocks.stride(-1) != 1:
        raise ValueError("blocks must be contiguous along head_dim (stride 1)")
    _, _, num_layers, page_size, num_kv_heads, head_dim = blocks.shape
    return pages_in_pool(blocks.shape[0]), num_layers, page_size, num_kv_heads, head_dim


def check_layer(layer: int, num_layers: int) -> None:
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), not {layer!r}")


def check_float(name: str, t: torch.Tensor, shape: tuple[int | None, ...], dtype: torch.dtype | None = None) -> None:
    """t has len(shape) dims, each equal to shape[i] where that is not None; float dtype; stride 1 last."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want_text = ", ".join("*" if w is None else str(w) for w in shape)
        raise ValueError(f"{name} must have shape [{want_text}], not {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} (the pool's dtype), not {t.dtype}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, not {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension (stride 1)")


def as_index(name: str, t: torch.Tensor, dims: int, size0: int | None = None) -> torch.Tensor:
    """An int32/int64 view of an integer index tensor; uint32 is reinterpreted as int32 (ids < 2**31)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.dim() != dims or (size0 is not None and t.shape[0] != size0):
        want = f"{size0} rows" if size0 is not None else f"{dims} dims"
        raise ValueError(f"{name} must have {dims} dims with {want}, not shape {list(t.shape)}")
    if t.dtype == torch.uint32:
        t = t.view(torch.int32)
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32, int64 or uint32, not {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")
    return t


def check_devices(blocks: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != blocks.device:
            raise ValueError(f"{name} is on {t.device} but blocks is on {blocks.device}")


def dot_precision(float32_operands: bool) -> str:
    """tl.dot's input_precision: float32 operands get exact float32 dots (tf32 would cost ~1e-3 relative
    error); 16-bit operands ignore it (tensor cores)."""
    return "ieee" if float32_operands else "tf32"


def dot_settings(dtype: torch.dtype, device: torch.device) -> dict[str, str | bool]:
    """DOT_PRECISION for float32 pools' operands (dot_precision). UPCAST_DOT: bf16 dots go through float32
    in the interpreter (CPU)."""
    return {
        "DOT_PRECISION": dot_precision(dtype == torch.float32),
        "UPCAST_DOT": device.type == "cpu" and dtype == torch.bfloat16,
    }


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_block(name: str, value: int, minimum: int = 16) -> int:
    """Tile sizes feed tl.arange and tl.dot: powers of 2, at least 16."""
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of 2 >= {minimum}, not {value!r}")
    return value


@dataclass
class PagedArgs:
    """The checked arguments of a paged attention launch (decode: query_start_loc is None)."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    batch: int
    lookup_table: torch.Tensor  # int32/int64 [batch, cols]
    cache_lengths: torch.Tensor  # int32/int64 [batch]
    query_start_loc: torch.Tensor | None  # int32/int64 [batch + 1]


def check_paged_args(
    q: torch.Tensor,
    blocks: torch.Tensor,
    layer: int,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
) -> PagedArgs:
    """q: [T, Hq, D] on a pool [N + 1, 2, L, P, Hkv, D]; without query_start_loc, one query per sequence (T = B)."""
    num_pages, num_layers, page_size, num_kv_heads, head_dim = check_blocks(blocks)
    check_layer(layer, num_layers)
    check_float("q", q, (None, None, head_dim), blocks.dtype)
    num_q_heads = q.shape[1]
    if num_q_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a positive multiple of num_kv_heads={num_kv_heads}")
    if query_start_loc is None:
        batch = q.shape[0]
        lut = as_index("lookup_table", lookup_table, 2, batch)
        cache_lengths = as_index("cache_lengths", cache_lengths, 1, batch)
        check_devices(blocks, q=q, lookup_table=lut, cache_lengths=cache_lengths)
    else:
        cache_lengths = as_index("cache_lengths", cache_lengths, 1)
        batch = cache_lengths.shape[0]
        query_start_loc = as_index("query_start_loc", query_start_loc, 1, batch + 1)
        lut = as_index("lookup_table", lookup_table, 2, batch)
        check_devices(blocks, q=q, lookup_table=lut, cache_lengths=cache_lengths, query_start_loc=query_start_loc)
    return PagedArgs(
        num_pages, page_size, num_kv_heads, head_dim, num_q_heads, batch, lut, cache_lengths, query_start_loc
    )


def output_buffers(
    q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out [T, Hq, D] in q's dtype and, with return_lse, lse float32 [T, Hq]: the given ones checked, or new."""
    if out is None:
        out = torch.empty_like(q)
    check_float("out", out, tuple(q.shape), q.dtype)
    if return_lse:
        rows, heads = q.shape[0], q.shape[1]
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device) if lse is None else lse
        if lse.shape != (rows, heads) or lse.dtype != torch.float32 or (lse.numel() and lse.stride(1) != 1):
            raise ValueError(f"lse must be float32 [{rows}, {heads}] with stride 1 last")
    return out, lse


def kernel_options(options: AttendOptions, head_dim: int, no_window: int) -> tuple[float, float, int, bool]:
    """(scale, softcap, window, use_softcap) as the decode and prefill kernels take them; `no_window` stands
    for no sliding window (wider than any context)."""
    scale, sliding_window, softcap = attend_options(options, head_dim)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, not {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0, not {softcap}")
    return float(scale), float(softcap or 1.0), min(sliding_window or no_window, no_window), bool(softcap)


def ragged_output(
    q: torch.Tensor,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
    width: int,
    max_q_len: int | None,
) -> tuple[torch.Tensor, int, int]:
    """The FP8 and MLA kernels' batch checks (asserts: only the engine calls them, past its own checks) and
    their output [T, Hq, width] in q's dtype: (out, batch, longest q_len), the last 0 when nothing is to run.
    The longest q_len is computed from query_start_loc where not given, which syncs."""
    batch = cache_lengths.shape[0]
    assert query_start_loc.shape == (batch + 1,) and lookup_table.shape[0] == batch
    expected = (q.shape[0], q.shape[1], width)
    if out is None:
        out = torch.empty(expected, dtype=q.dtype, device=q.device)
    assert out.shape == expected and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0 or q.shape[0] == 0:
        return out, batch, 0
    if max_q_len is None:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    return out, batch, max_q_len
