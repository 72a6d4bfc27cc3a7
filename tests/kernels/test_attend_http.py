"""POST /v1/attend through the Triton kernels on a real server (interpreter on the CPU)."""

import torch

from tests.conftest import Server, dec, enc
from tests.kernels.paged_data import dense_attention

# SMALL_POOL: 2 layers, 2 KV heads, head_dim 16, page 4, 16 pages, float32, cpu. TRITON_INTERPRET=0 is
# passed on purpose: the engine must switch the interpreter on itself for a CPU pool.
TRITON_ENV = {"KVPOOL_ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "0"}


def test_attend_with_window_and_softcap_runs_the_kernels(start_server) -> None:  # type: ignore[no-untyped-def]
    server: Server = start_server(TRITON_ENV)
    c = server.client
    assert c.get("/v1/pool").json()["attention_backend"] == "triton"
    gen = torch.Generator().manual_seed(11)
    lengths = {"a": 9, "b": 4}  # b ends on a page boundary
    kv = {}
    for seq_id, n in lengths.items():
        assert c.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201
        k, v = torch.randn(2, n, 2, 16, generator=gen), torch.randn(2, n, 2, 16, generator=gen)
        r = c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": n, "k": enc(k), "v": enc(v)})
        assert r.status_code == 200, r.text  # K/V of both layers written by the store kernel
        kv[seq_id] = (k[1], v[1])
    options = {"sliding_window": 3, "softcap": 2.5, "scale": 0.4}

    # Chunked prefill: the last 3 and 2 positions of a and b (the prefill kernel).
    q = torch.randn(5, 8, 16, generator=gen)
    body = {"layer": 1, "seq_ids": ["a", "b"], "q": enc(q), "q_lens": [3, 2], **options}
    r = c.post("/v1/attend", json=body)
    assert r.status_code == 200, r.text
    out = dec(r.json()["out"])
    want_a, _ = dense_attention(q[:3], torch.arange(6, 9), *kv["a"], **options)
    want_b, _ = dense_attention(q[3:], torch.arange(2, 4), *kv["b"], **options)
    torch.testing.assert_close(out.double(), torch.cat([want_a, want_b]), atol=1e-5, rtol=1e-5)

    # Decode: one new token each, its K/V written by /v1/attend itself (store then the decode kernel).
    for seq_id in lengths:
        assert c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": 1}).status_code == 200
    q = torch.randn(2, 8, 16, generator=gen)
    k_new, v_new = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    body = {"layer": 1, "seq_ids": ["a", "b"], "q": enc(q), "k": enc(k_new), "v": enc(v_new), **options}
    r = c.post("/v1/attend", json=body)
    assert r.status_code == 200, r.text
    out = dec(r.json()["out"])
    for i, (seq_id, n) in enumerate(lengths.items()):
        k = torch.cat([kv[seq_id][0], k_new[i : i + 1]])
        v = torch.cat([kv[seq_id][1], v_new[i : i + 1]])
        want, _ = dense_attention(q[i : i + 1], torch.tensor([n]), k, v, **options)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)
