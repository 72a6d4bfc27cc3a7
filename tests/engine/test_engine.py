"""The engine's backend choice (auto: cpu for a plain CPU pool, torch for FP8 and MLA; explicit settings as
given) and its device work through the backend: attention as dense attention answers, whole-page copies."""

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kernels import cpu_decode
from service.config import Settings
from service.engine.backends import Fp8Pages, MlaPages, PlainPages
from service.engine.engine import DeviceEngine
from service.engine.storage import Storage
from tests.kernels.paged_data import assert_close, dense_attention, place_sequences

SETTINGS = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=16, device="cpu")


@pytest.fixture
def storage() -> Iterator[Storage]:
    s = Storage(Settings(**SETTINGS))  # type: ignore[arg-type]
    yield s
    s.close()


@pytest.mark.parametrize(
    ("setting", "backend", "compiled_calls"), [("auto", "cpu", 1), ("cpu", "cpu", 1), ("torch", "torch", 0)]
)
def test_a_cpu_pool_decodes_on_its_backend(
    storage: Storage, monkeypatch: pytest.MonkeyPatch, setting: str, backend: str, compiled_calls: int
) -> None:
    native = cpu_decode.native
    assert native is not None
    calls = []

    class CountingNative:  # the real kernel, its calls counted
        @staticmethod
        def decode(*args: Any) -> None:
            calls.append(1)
            native.decode(*args)

    monkeypatch.setattr(cpu_decode, "native", CountingNative)
    engine = DeviceEngine(storage, setting)
    assert engine.backend == backend and isinstance(engine.impl, PlainPages)
    lengths = [5, 9]
    seqs = place_sequences(storage.blocks, 1, lengths, seed=2)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    cache_lengths = torch.tensor([n - 1 for n in lengths])
    lut = seqs.lookup_table.to(torch.int64)
    out = engine.call(lambda: engine.attend(q, 1, lut, cache_lengths, torch.arange(3), softcap=3.0))
    assert len(calls) == compiled_calls
    for i, n in enumerate(lengths):
        dense, _ = dense_attention(q[i : i + 1], torch.tensor([n - 1]), seqs.keys[i], seqs.values[i], softcap=3.0)
        assert_close(out[i : i + 1], dense, torch.float32, f"sequence {i}")
    # A chunked prefill (two queries of the second sequence) takes the torch path on either backend.
    calls.clear()
    out = engine.call(lambda: engine.attend(q, 1, lut[1:], torch.tensor([7]), torch.tensor([0, 2])))
    dense, _ = dense_attention(q, torch.tensor([7, 8]), seqs.keys[1], seqs.values[1])
    assert_close(out, dense, torch.float32, "prefill")
    assert calls == []
    engine.close()


@pytest.mark.parametrize(
    ("special", "kind"),
    [
        ({"dtype": "float8_e4m3fn", "quant_granularity": 16}, Fp8Pages),
        ({"mla": True, "num_kv_heads": 1, "head_dim": 32, "kv_lora_rank": 16}, MlaPages),
    ],
)
def test_fp8_and_mla_pools_on_the_cpu_run_their_references_as_backend_torch(
    special: dict[str, Any], kind: type
) -> None:
    storage = Storage(Settings(**{**SETTINGS, **special}))  # type: ignore[arg-type]
    try:
        engine = DeviceEngine(storage, "auto")
        assert engine.backend == "torch" and isinstance(engine.impl, kind)
        engine.close()
    finally:
        storage.close()


def test_the_cpu_backend_refuses_a_pool_on_another_device(storage: Storage) -> None:
    class CudaStorage:  # what DeviceEngine reads of a CUDA pool's storage, before touching any tensor
        blocks, scales, mla, dtype = storage.blocks, None, False, storage.dtype
        device = torch.device("cuda", 0)

    with pytest.raises(RuntimeError, match="'cpu' runs on a CPU pool, not on cuda:0"):
        DeviceEngine(CudaStorage(), "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "special",
    [
        {},
        {"dtype": "float8_e4m3fn", "quant_granularity": 16},
        {"mla": True, "num_kv_heads": 1, "head_dim": 32, "kv_lora_rank": 16},
    ],
)
def test_copy_pages_copies_everything_a_page_holds(special: dict[str, Any]) -> None:
    storage = Storage(Settings(**{**SETTINGS, **special}))  # type: ignore[arg-type]
    try:
        engine = DeviceEngine(storage, "auto")
        gen = torch.Generator().manual_seed(1)
        storage.blocks.copy_(torch.randn(storage.blocks.shape, generator=gen).to(storage.blocks.dtype))
        if storage.scales is not None:
            storage.scales.copy_(torch.rand(storage.scales.shape, generator=gen))
        before = [t.clone() for t in (storage.blocks, storage.scales) if t is not None]
        engine.call(lambda: engine.copy_pages([(3, 7), (5, 2)]))
        for was, now in zip(before, [t for t in (storage.blocks, storage.scales) if t is not None], strict=True):
            want = was.clone()
            want[7], want[2] = was[3], was[5]
            assert torch.equal(now.view(torch.uint8), want.view(torch.uint8))  # bytes: FP8 has no ==
        engine.close()
    finally:
        storage.close()


@pytest.mark.parametrize(
    ("special", "setting", "kind", "name"),
    [
        ({}, "triton", PlainPages, "triton"),  # a CPU pool: the kernels through Triton's interpreter
        ({"dtype": "float8_e4m3fn", "quant_granularity": 16}, "cpu", Fp8Pages, "cpu"),  # the FP8 reference
        ({"dtype": "float8_e4m3fn", "quant_granularity": 16}, "triton", Fp8Pages, "triton"),
        ({"mla": True, "num_kv_heads": 1, "head_dim": 32, "kv_lora_rank": 16}, "triton", MlaPages, "triton"),
    ],
)
def test_an_explicit_setting_picks_its_backend(
    special: dict[str, Any], setting: str, kind: type, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CPU pool on triton sets TRITON_INTERPRET for the process: restored after this test, so that the
    # tests after it (on a GPU machine) still run the compiled kernels.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))
    storage = Storage(Settings(**{**SETTINGS, **special}))  # type: ignore[arg-type]
    try:
        engine = DeviceEngine(storage, setting)
        assert isinstance(engine.impl, kind) and engine.impl.name == engine.backend == name
        engine.close()
    finally:
        storage.close()


def test_an_unknown_backend_is_refused(storage: Storage) -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        DeviceEngine(storage, "cuda")
