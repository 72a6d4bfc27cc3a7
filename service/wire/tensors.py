"""The JSON tensor codec: {"dtype", "shape", "data": base64 of C-contiguous little-endian bytes}."""

import base64
import binascii
import math
from typing import Any

import numpy as np
import torch

from service.core.errors import InvalidRequest

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint32": torch.uint32,
    "int32": torch.int32,
    "int64": torch.int64,
}
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # numpy has no bfloat16: carried as its raw 16 bits
    "uint32": np.dtype("<u4"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def decode(name: str, dtype: str, shape: list[int], data: str) -> torch.Tensor:
    """A CPU tensor from its JSON form; a clear InvalidRequest for any mismatch."""
    np_dtype = NUMPY_DTYPES[dtype]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{name}.data is not valid base64") from None
    expected = math.prod(shape) * np_dtype.itemsize
    if len(raw) != expected:
        raise InvalidRequest(f"{name}: shape {shape} of {dtype} needs {expected} bytes, data has {len(raw)}")
    array = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
    tensor = torch.from_numpy(array.copy())
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def encode(tensor: torch.Tensor) -> dict[str, Any]:
    tensor = tensor.detach().to("cpu").contiguous()
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"cannot encode a tensor of {tensor.dtype}")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return encode_array(tensor.numpy(), name)


def encode_array(array: np.ndarray, dtype: str) -> dict[str, Any]:
    """Encode a numpy array whose bytes already have `dtype`'s little-endian layout."""
    data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
    return {"dtype": dtype, "shape": list(array.shape), "data": data}
