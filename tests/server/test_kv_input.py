"""all_finite: the one check of every attend's q and output, against torch.isfinite on every float dtype."""

import pytest
import torch

from service.server.kv_input import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_agrees_with_torch_isfinite(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 8, 64, generator=g) * 1e3).to(dtype)
    assert all_finite(x)
    # The largest finite values and the smallest subnormals are finite too.
    info = torch.finfo(dtype)
    edge = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4, 0.0, -0.0]).to(dtype)
    assert all_finite(edge) and bool(torch.isfinite(edge).all())
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[int(torch.randint(32, (1,), generator=g)), 3, 17] = bad
        assert not all_finite(y) and not bool(torch.isfinite(y).all())
        assert not all_finite(y[:, 3])  # a strided view
