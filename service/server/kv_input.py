"""K/V given with append or attend, checked against the pool's kind (plain, FP8, MLA); q, checked alike."""

import numpy as np
import torch

from service.core.errors import InvalidRequest
from service.pool import PoolState
from service.wire.models import Tensor
from service.wire.tensors import decode


def decode_kv_input(
    pool: PoolState, k: Tensor | None, v: Tensor | None, leading: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(k, v) of shape leading + [num_kv_heads, head_dim], None when neither is given.

    A plain or FP8 pool takes k and v together (FP8 quantizes them on store); an MLA pool takes the
    latent as k alone (v is its first kv_lora_rank channels, not sent).
    """
    s = pool.settings
    if s.mla and v is not None:
        raise InvalidRequest("an MLA pool stores one latent per token: send it as k, without v")
    if not s.mla and (k is None) != (v is None):
        raise InvalidRequest("k and v come together")
    if k is None:
        return None
    shape = [*leading, s.num_kv_heads, s.head_dim]
    out = []
    for name, t in (("k", k), ("v", v)):
        if t is None:
            continue
        if t.shape != shape:
            raise InvalidRequest(f"{name} must have shape {shape}, not {t.shape}")
        out.append(decode_finite(name, t))
    return out[0], (out[1] if len(out) > 1 else None)


def decode_finite(name: str, t: Tensor) -> torch.Tensor:
    """A floating-point tensor of a request (k, v, q), decoded; 422 for another dtype or a NaN or
    infinite value, which would turn every output that reads it into NaN."""
    if not t.dtype.startswith(("float", "bfloat")):
        raise InvalidRequest(f"{name} must be a floating-point tensor, not {t.dtype}")
    x = decode(name, t.dtype, t.shape, t.data)
    if not all_finite(x):
        raise InvalidRequest(f"{name} has NaN or infinite values")
    return x


# 16-bit floats on the CPU: (the same-width integer view, its exponent bits). A value is NaN or infinite
# exactly when its exponent bits are all set. torch.isfinite on a CPU bfloat16 tensor of 32 x 32 x 128 took
# ~5 ms here (and was most of an attend's overhead on the first GPU run, whose output comes back as bf16);
# the bit test through numpy takes ~60 us.
EXPONENT_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def all_finite(x: torch.Tensor) -> bool:
    """torch.isfinite(x).all(), through numpy where it can (CPU tensors)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return bool(np.isfinite(x.numpy()).all())
    mask = EXPONENT_BITS.get(x.dtype)
    if x.device.type == "cpu" and mask is not None:
        bits = x.contiguous().view(torch.int16).numpy().view(np.uint16)
        return not bool(((bits & mask) == mask).any())
    return bool(torch.isfinite(x).all())


def kv_nbytes(kv: tuple[torch.Tensor, torch.Tensor | None] | None) -> int:
    """Bytes of the K/V decode_kv_input() returned (0 for None)."""
    return 0 if kv is None else sum(t.nbytes for t in kv if t is not None)
