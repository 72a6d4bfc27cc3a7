"""The wrappers reject bad arguments with a clear ValueError before anything launches."""

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels.decode import paged_decode
from kernels.prefill import paged_prefill
from kernels.store import store_kv

N, L, P, H, D = 4, 2, 4, 2, 64


def pool(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    blocks = torch.randn(N + 1, 2, L, P, H, D).to(dtype)
    blocks[N] = 0
    return blocks


def lut(rows: int = 2) -> torch.Tensor:
    return torch.full((rows, 24), N, dtype=torch.uint32)


def decode_args(**change: Any) -> dict[str, Any]:
    args = {
        "q": torch.randn(2, 4, D),
        "blocks": pool(),
        "layer": 0,
        "lookup_table": lut(),
        "cache_lengths": torch.zeros(2, dtype=torch.int64),
    }
    return {**args, **change}


def prefill_args(**change: Any) -> dict[str, Any]:
    args = {**decode_args(), "q": torch.randn(3, 4, D), "query_start_loc": torch.tensor([0, 1, 3])}
    return {**args, **change}


def store_args(**change: Any) -> dict[str, Any]:
    args = {
        "blocks": pool(),
        "k": torch.randn(3, H, D),
        "v": torch.randn(3, H, D),
        "slots": torch.arange(3),
        "layer": 1,
    }
    return {**args, **change}


CASES: list[tuple[Callable[..., Any], dict[str, Any], str]] = [
    (paged_decode, decode_args(blocks=torch.randn(N + 1, 2, L, P, H)), "blocks must be"),
    (paged_decode, decode_args(blocks=pool().to(torch.int32)), "blocks must be float32"),
    (
        paged_decode,
        decode_args(blocks=pool().transpose(-1, -2).contiguous().transpose(-1, -2)),
        "contiguous along head_dim",
    ),
    (paged_decode, decode_args(layer=L), "layer must be"),
    (paged_decode, decode_args(q=torch.randn(2, 4, D + 1)), "q must have shape"),
    (paged_decode, decode_args(q=torch.randn(2, 3, D)), "multiple of num_kv_heads"),
    (paged_decode, decode_args(q=torch.randn(2, 4, D).half()), "pool's dtype"),
    (paged_decode, decode_args(q=torch.randn(2, 4, 2 * D)[..., ::2]), "contiguous along its last"),
    (paged_decode, decode_args(lookup_table=lut(3)), "lookup_table must have 2 dims with 2 rows"),
    (paged_decode, decode_args(lookup_table=lut().float()), "lookup_table must be int32"),
    (paged_decode, decode_args(cache_lengths=torch.zeros(3, dtype=torch.int32)), "cache_lengths must have"),
    (paged_decode, decode_args(num_splits=3), "num_splits must be a power of 2"),
    (paged_decode, decode_args(sliding_window=0), "sliding_window must be >= 1"),
    (paged_decode, decode_args(block_n=8), "block_n must be a power of 2 >= 16"),
    (paged_prefill, prefill_args(block_n=48), "block_n must be a power of 2 >= 16"),
    (paged_decode, decode_args(softcap=-1.0), "softcap must be > 0"),
    (paged_decode, decode_args(out=torch.empty(2, 4, D).half()), "out must be"),
    (paged_decode, decode_args(return_lse=True, lse=torch.empty(2, 5)), "lse must be float32 [2, 4]"),
    (paged_prefill, prefill_args(query_start_loc=torch.tensor([0, 3])), "query_start_loc must have"),
    (paged_prefill, prefill_args(query_start_loc=torch.tensor([0.0, 1.0, 3.0])), "query_start_loc must be int32"),
    (paged_prefill, prefill_args(q=torch.randn(3, 4)), "q must have shape"),
    (paged_prefill, prefill_args(q=torch.randn(3, 64, D), block_m=16), "block_m must be a power of 2"),
    (paged_prefill, prefill_args(block_m=24), "block_m must be a power of 2"),
    (store_kv, store_args(k=torch.randn(3, H + 1, D)), "k must have shape"),
    (store_kv, store_args(v=torch.randn(2, H, D)), "v must have shape"),
    (store_kv, store_args(layer=None), "k must have shape [2, *, 2, 64]"),
    (store_kv, store_args(layer=-1), "layer must be"),
    (store_kv, store_args(slots=torch.arange(4)), "slots must have 1 dims with 3 rows"),
    (store_kv, store_args(slots=torch.arange(3).float()), "slots must be int32"),
    (store_kv, store_args(k=torch.randint(0, 3, (3, H, D))), "k must be float32"),
]


@pytest.mark.parametrize(("fn", "kwargs", "message"), CASES)
def test_bad_arguments_raise_value_error(fn: Callable[..., Any], kwargs: dict[str, Any], message: str) -> None:
    before = kwargs["blocks"].clone()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("*", r"\*")):
        fn(**kwargs)
    assert torch.equal(kwargs["blocks"], before)  # nothing was written


def test_an_unknown_option_is_refused_as_an_unknown_keyword_would_be() -> None:
    """The attention options arrive as **options (kernels.options.AttendOptions): a misspelt one must not be
    silently ignored, by the kernels or by their references."""
    from kernels.reference import paged_attention_ref

    out = torch.full((3, 4, D), float("nan"))
    for fn, kwargs in (
        (paged_decode, decode_args()),
        (paged_prefill, prefill_args(out=out)),
        (paged_attention_ref, prefill_args()),
    ):
        with pytest.raises(TypeError, match="unexpected keyword argument 'soft_cap'"):
            fn(**kwargs, soft_cap=2.0)
    assert torch.isnan(out).all()  # refused before anything launched
