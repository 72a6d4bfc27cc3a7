"""FP8 and MLA pools through a real server: settings, /v1/pool, append, fork, attend."""

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from kernels.reference_fp8 import dequantize_fp8, quantize_fp8
from tests.conftest import REPO, SMALL_POOL, Server, dec, enc, free_port
from tests.e2e.test_walkthrough import dense_attention
from tests.kernels.test_attention_fp8 import FP8_REL_ERROR_BOUND
from tests.kernels.test_mla import dense_mla

L, H, D = 2, 2, 16  # the conftest small pool
FP8 = {"KVPOOL_DTYPE": "float8_e4m3fn", "KVPOOL_QUANT_GRANULARITY": "8"}
MLA = {"KVPOOL_MLA": "true", "KVPOOL_NUM_KV_HEADS": "1", "KVPOOL_HEAD_DIM": "40", "KVPOOL_KV_LORA_RANK": "32"}
BACKENDS = ["torch", "triton"]  # triton runs the kernels (under TRITON_INTERPRET=1 without a GPU)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """What an FP8 pool with g = 8 and float32 scales holds for x [..., D]."""
    return dequantize_fp8(*quantize_fp8(x, 8))


def attend(c: Any, seq_ids: list[str], q: torch.Tensor, q_lens: list[int], **extra: Any) -> torch.Tensor:
    r = c.post("/v1/attend", json={"layer": 1, "seq_ids": seq_ids, "q": enc(q), "q_lens": q_lens, **extra})
    assert r.status_code == 200, r.text
    return dec(r.json()["out"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_pool_append_fork_attend(start_server: Any, backend: str) -> None:
    server: Server = start_server({**FP8, "KVPOOL_ATTENTION_BACKEND": backend})
    c = server.client
    pool = c.get("/v1/pool").json()
    assert (pool["dtype"], pool["scale_dtype"], pool["quant_granularity"]) == ("float8_e4m3fn", "float32", 8)
    assert pool["mla"] is False and pool["kv_lora_rank"] is None

    torch.manual_seed(4)
    k, v = torch.randn(L, 6, H, D) * 3, torch.randn(L, 6, H, D)
    assert c.post("/v1/sequences", json={"seq_id": "a"}).status_code == 201
    r = c.post("/v1/sequences/a/append", json={"num_tokens": 6, "k": enc(k), "v": enc(v)})
    assert r.status_code == 200 and r.json()["block_table"] == [0, 1]

    q = torch.randn(3, 4, D)
    out = attend(c, ["a"], q, [3])
    expected = dense_attention(q, fp8_roundtrip(k[1]), fp8_roundtrip(v[1]))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    exact = dense_attention(q, k[1], v[1])
    assert float((out.double() - exact).norm() / exact.norm()) < FP8_REL_ERROR_BOUND

    # Fork shares page 1 (2 of 4 tokens); the child's append copies it on write, scales included.
    assert c.post("/v1/sequences/a/fork", json={"seq_id": "b"}).status_code == 201
    k2, v2, q2 = torch.randn(L, 1, H, D), torch.randn(L, 1, H, D), torch.randn(1, 4, D)
    r = c.post("/v1/sequences/b/append", json={"num_tokens": 1, "k": enc(k2), "v": enc(v2)})
    assert r.status_code == 200 and r.json()["block_table"] == [0, 2]
    out = attend(c, ["b", "a"], torch.cat([q2, q[2:]]), [1, 1])
    kb, vb = torch.cat([k[1], k2[1]]), torch.cat([v[1], v2[1]])
    torch.testing.assert_close(
        out[:1].double(), dense_attention(q2, fp8_roundtrip(kb), fp8_roundtrip(vb)), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(out[1:].double(), expected[2:], atol=1e-5, rtol=1e-5)

    # Non-finite K/V are refused before anything changes.
    bad = torch.randn(L, 1, H, D)
    bad[0, 0, 0, 3] = float("nan")
    r = c.post("/v1/sequences/a/append", json={"num_tokens": 1, "k": enc(bad), "v": enc(bad)})
    assert r.status_code == 422 and "NaN" in r.json()["error"]["message"]
    assert c.get("/v1/sequences/a").json()["length"] == 6

    # A decode step: one token appended by /v1/step, its K/V written by attend (layer 1), attended.
    assert c.post("/v1/step", json={"appends": [{"seq_id": "a", "num_tokens": 1}]}).status_code == 200
    k1, v1, q1 = torch.randn(1, H, D), torch.randn(1, H, D), torch.randn(1, 4, D)
    out = attend(c, ["a"], q1, [1], k=enc(k1), v=enc(v1))
    kall, vall = torch.cat([k[1], k1]), torch.cat([v[1], v1])
    expected = dense_attention(q1, fp8_roundtrip(kall), fp8_roundtrip(vall))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"KVPOOL_DTYPE": "float8_e4m3fn"}, "KVPOOL_QUANT_GRANULARITY=128 must divide KVPOOL_HEAD_DIM=16"),
        ({"KVPOOL_MLA": "true"}, "KVPOOL_NUM_KV_HEADS must be 1"),
        ({**MLA, "KVPOOL_KV_LORA_RANK": "40"}, "KVPOOL_KV_LORA_RANK=40 must be less than KVPOOL_HEAD_DIM=40"),
    ],
)
def test_invalid_format_settings_stop_the_server(env: dict[str, str], message: str) -> None:
    """`kvpool serve` (the real entry point) exits non-zero naming the setting."""
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(free_port())]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **SMALL_POOL, **env}
    done = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_pool_append_latent_attend(start_server: Any, backend: str) -> None:
    c = start_server({**MLA, "KVPOOL_ATTENTION_BACKEND": backend}).client
    pool = c.get("/v1/pool").json()
    assert pool["mla"] is True and pool["kv_lora_rank"] == 32 and pool["num_kv_heads"] == 1
    assert pool["scale_dtype"] is None and pool["quant_granularity"] is None

    torch.manual_seed(6)
    latent = torch.randn(L, 6, 1, 40)
    c.post("/v1/sequences", json={"seq_id": "m"})
    r = c.post("/v1/sequences/m/append", json={"num_tokens": 6, "k": enc(latent), "v": enc(latent)})
    assert r.status_code == 422 and "without v" in r.json()["error"]["message"]
    r = c.post("/v1/sequences/m/append", json={"num_tokens": 6, "k": enc(torch.randn(L, 6, 2, 40))})
    assert r.status_code == 422 and "[2, 6, 1, 40]" in r.json()["error"]["message"]
    assert c.get("/v1/sequences/m").json()["length"] == 0
    r = c.post("/v1/sequences/m/append", json={"num_tokens": 6, "k": enc(latent)})
    assert r.status_code == 200, r.text

    q = torch.randn(3, 8, 40)
    out = attend(c, ["m"], q, [3])
    assert out.shape == (3, 8, 32)
    torch.testing.assert_close(out.double(), dense_mla(q, latent[1, :, 0], 32), atol=1e-5, rtol=1e-5)

    # Decode: append one token, write its latent through attend, attend to all 7.
    assert c.post("/v1/step", json={"appends": [{"seq_id": "m", "num_tokens": 1}]}).status_code == 200
    new, q1 = torch.randn(1, 1, 40), torch.randn(1, 8, 40)
    out = attend(c, ["m"], q1, [1], k=enc(new))
    expected = dense_mla(q1, torch.cat([latent[1, :, 0], new[:, 0]]), 32)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_page_nbytes_counts_scales_and_the_latent() -> None:
    from service.config import Settings

    # FP8: 2 (K, V) × 16 tokens × 2 heads × (64 one-byte values + 1 float32 scale) × 4 layers.
    fp8 = Settings(dtype="float8_e4m3fn", quant_granularity=64, device="cpu")
    assert fp8.page_nbytes == 2 * 16 * 2 * (64 + 4) * 4 == 17408
    # MLA: 1 latent × 16 tokens × 1 head × 576 float32 channels × 4 layers.
    mla = Settings(mla=True, num_kv_heads=1, head_dim=576, kv_lora_rank=512, device="cpu")
    assert mla.page_nbytes == 16 * 576 * 4 * 4 == 147456
    assert Settings(device="cpu").page_nbytes == 2 * 16 * 2 * 64 * 4 * 4


def _map(ipc: dict[str, Any], key: str) -> torch.Tensor:
    """A read-only copy of an exported memfd tensor: its descriptor from the server's socket, then pread."""
    import numpy as np

    from service.ipc.fd_socket import receive_fds

    desc, handle = ipc[key], ipc[key]["handle"]
    answer, fds = receive_fds(ipc["socket"], None)
    try:
        assert answer["keys"][handle["fd_index"]] == key
        raw = os.pread(fds[handle["fd_index"]], handle["nbytes"], handle["offset"])
    finally:
        for fd in fds:
            os.close(fd)
    if desc["dtype"] == "float8_e4m3fn":
        return torch.from_numpy(np.frombuffer(raw, np.uint8).copy()).view(torch.float8_e4m3fn).view(desc["shape"])
    return torch.from_numpy(np.frombuffer(raw, np.float32).copy()).view(desc["shape"])


def answer_keys(ipc: dict[str, Any]) -> list[str]:
    return sorted((k for k in ("blocks", "scales") if k in ipc), key=lambda k: ipc[k]["handle"]["fd_index"])


def test_fp8_ipc_exports_values_and_scales(start_server: Any) -> None:
    """GET /v1/ipc hands out `scales` beside `blocks`; both hold exactly what the store wrote."""
    c = start_server(FP8).client
    ipc = c.get("/v1/ipc").json()
    assert ipc["blocks"]["dtype"] == "float8_e4m3fn" and ipc["scales"]["dtype"] == "float32"
    assert ipc["scales"]["shape"] == [17, 2, L, 4, H, D // 8]
    torch.manual_seed(7)
    k, v = torch.randn(L, 5, H, D) * 2, torch.randn(L, 5, H, D)
    assert c.post("/v1/sequences", json={"seq_id": "s"}).status_code == 201
    r = c.post("/v1/sequences/s/append", json={"num_tokens": 5, "k": enc(k), "v": enc(v)})
    assert r.json()["slots"] == [0, 1, 2, 3, 4]
    assert ipc["kind"] == "memfd" and answer_keys(ipc) == ["blocks", "scales"]
    blocks, scales = _map(ipc, "blocks"), _map(ipc, "scales")
    for kv_index, x in ((0, k), (1, v)):
        values, expected_scales = quantize_fp8(x, 8)  # [L, 5, H, D], [L, 5, H, D // 8]
        got = torch.cat([blocks[0, kv_index], blocks[1, kv_index, :, :1]], dim=1)  # [L, 5, H, D]
        got_scales = torch.cat([scales[0, kv_index], scales[1, kv_index, :, :1]], dim=1)
        assert torch.equal(got.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(got_scales, expected_scales)
    assert not scales[1, :, :, 1:].any() and not scales[2:].any()  # unwritten slots and the null page
    assert not blocks[2:].view(torch.uint8).any()


def test_fp8_e5m2_pool_attends_and_maps_its_scales(start_server: Any) -> None:
    """An e5m2 pool (vLLM's fp8_e5m2 caches): e5m2 values with per-group scales, attended by the references
    (auto picks torch), and both tensors mapped by a client's attach()."""
    from service.client import KVPoolClient

    server: Server = start_server({**FP8, "KVPOOL_DTYPE": "float8_e5m2"})
    c = server.client
    pool = c.get("/v1/pool").json()
    assert (pool["dtype"], pool["scale_dtype"], pool["quant_granularity"]) == ("float8_e5m2", "float32", 8)
    torch.manual_seed(9)
    k, v = torch.randn(L, 5, H, D) * 3, torch.randn(L, 5, H, D)
    assert c.post("/v1/sequences", json={"seq_id": "a"}).status_code == 201
    assert c.post("/v1/sequences/a/append", json={"num_tokens": 5, "k": enc(k), "v": enc(v)}).status_code == 200
    q = torch.randn(2, 4, D)
    out = attend(c, ["a"], q, [2])

    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(*quantize_fp8(x, 8, torch.float32, torch.float8_e5m2))

    expected = dense_attention(q, roundtrip(k[1]), roundtrip(v[1]))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    with KVPoolClient(server.url) as client, client.attach() as mapped:
        assert mapped.blocks.dtype == torch.float8_e5m2 and mapped.scales is not None
        values, scales = quantize_fp8(k, 8, torch.float32, torch.float8_e5m2)  # [L, 5, H, D], [L, 5, H, D // 8]
        held = torch.cat([mapped.blocks[0, 0], mapped.blocks[1, 0, :, :1]], dim=1)
        held_scales = torch.cat([mapped.scales[0, 0], mapped.scales[1, 0, :, :1]], dim=1)
        assert torch.equal(held.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(held_scales, scales)


def test_fp8_e5m2_pool_refuses_the_triton_backend() -> None:
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(free_port())]
    env = {**SMALL_POOL, **FP8, "KVPOOL_DTYPE": "float8_e5m2", "KVPOOL_ATTENTION_BACKEND": "triton"}
    done = subprocess.run(
        cmd, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "the Triton FP8 kernels store and read e4m3" in done.stderr
