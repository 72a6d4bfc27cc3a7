"""The dtypes kvpool knows, in one table: name -> itemsize, numpy dtype of the wire bytes, torch dtype.

The names are the torch attribute names. Each `Literal` below is one use's subset of them, written
once: the settings (`PoolDtype`, `ScaleDtype`), what GET /v1/ipc exports (`StoredDtype`) and the JSON
tensor codec (`TensorDtype`). The table's keys are built from them, so a name can only be added in
one place. torch is imported on first use, so that reading the settings does not pay for it.
"""

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np

if TYPE_CHECKING:
    import torch

PoolDtype = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
# FP8 pools: values in one of these formats plus per-group scales (value = fp8 * scale). e5m2 is kept for
# vLLM's fp8_e5m2 KV caches, whose bytes the connector stores as they are.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
ScaleDtype = Literal["float32", "bfloat16"]  # FP8 pools: the per-group scales
StoredDtype = Literal[PoolDtype, ScaleDtype]  # the pool tensors GET /v1/ipc exports
TensorDtype = Literal["float32", "float16", "bfloat16", "uint32", "int32", "int64"]  # JSON tensors

# numpy has no bfloat16 or float8: their bytes are carried as unsigned integers of the same width.
_RAW_BITS = {"bfloat16": "<u2", "float8_e4m3fn": "<u1", "float8_e5m2": "<u1"}


@dataclass(frozen=True)
class Dtype:
    name: str
    wire: np.dtype[Any]  # little-endian numpy dtype of the bytes (raw bits where numpy lacks the type)

    @property
    def itemsize(self) -> int:
        return self.wire.itemsize

    @property
    def torch(self) -> "torch.dtype":
        return _torch_dtypes()[self.name]


def _dtype(name: str) -> Dtype:
    return Dtype(name, np.dtype(_RAW_BITS.get(name, name)).newbyteorder("<"))


DTYPES: dict[str, Dtype] = {name: _dtype(name) for name in get_args(Literal[StoredDtype, TensorDtype])}
TENSOR_DTYPES = frozenset(get_args(TensorDtype))


@cache
def _torch_dtypes() -> "dict[str, torch.dtype]":
    import torch

    return {name: getattr(torch, name) for name in DTYPES}


@cache
def _names() -> "dict[torch.dtype, str]":
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def dtype_name(dtype: "torch.dtype") -> str | None:
    """The table's name of a torch dtype; None for one kvpool does not carry."""
    return _names().get(dtype)
