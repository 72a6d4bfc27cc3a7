"""The JSON tensor codec: {"dtype", "shape", "data": base64 of C-contiguous little-endian bytes}."""

import base64
import binascii
import math
from typing import Any

import numpy as np
import torch

from service.core.errors import InvalidRequest
from service.wire.dtypes import DTYPES, TENSOR_DTYPES, dtype_name


def decode(name: str, dtype: str, shape: list[int], data: str) -> torch.Tensor:
    """A CPU tensor from its JSON form; a clear InvalidRequest for any mismatch."""
    spec = DTYPES[dtype]
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{name}.data is not valid base64") from None
    expected = math.prod(shape) * spec.itemsize
    if len(raw) != expected:
        raise InvalidRequest(f"{name}: shape {shape} of {dtype} needs {expected} bytes, data has {len(raw)}")
    array = np.frombuffer(raw, dtype=spec.wire).reshape(shape)
    tensor = torch.from_numpy(array.copy())
    return tensor if tensor.dtype == spec.torch else tensor.view(spec.torch)  # raw bits (bfloat16)


def encode(tensor: torch.Tensor) -> dict[str, Any]:
    name = dtype_name(tensor.dtype)
    if name is None or name not in TENSOR_DTYPES:
        raise ValueError(f"cannot encode a tensor of {tensor.dtype}")
    tensor = tensor.detach().to("cpu").contiguous()
    data = base64.b64encode(tensor.reshape(-1).view(torch.uint8).numpy().tobytes()).decode("ascii")
    return {"dtype": name, "shape": list(tensor.shape), "data": data}


def encode_array(array: np.ndarray, dtype: str) -> dict[str, Any]:
    """Encode a numpy array whose bytes already have `dtype`'s little-endian layout."""
    data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
    return {"dtype": dtype, "shape": list(array.shape), "data": data}
