"""The README walk-through against a real server: allocate -> append -> attend -> free."""

import math

import torch

from tests.conftest import Server, dec, enc


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [Tq, Hq, D] at the last Tq positions of k, v: [Tk, Hkv, D]; causal; float64."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(d)
    q_pos = torch.arange(tk - tq, tk)[:, None]
    s = s.masked_fill(torch.arange(tk)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def test_allocate_append_attend_free(server: Server) -> None:
    c = server.client
    torch.manual_seed(0)
    r = c.post("/v1/sequences", json={"seq_id": "s1"})
    assert r.status_code == 201
    assert r.json() == {"seq_id": "s1", "length": 0, "block_table": [], "cached_tokens": 0}

    k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)
    r = c.post("/v1/sequences/s1/append", json={"num_tokens": 6, "k": enc(k), "v": enc(v)})
    assert r.status_code == 200
    body = r.json()
    assert body["length"] == 6 and body["block_table"] == [0, 1]
    assert body["slots"] == [0, 1, 2, 3, 4, 5]

    q = torch.randn(3, 4, 16)
    r = c.post("/v1/attend", json={"layer": 1, "seq_ids": ["s1"], "q": enc(q), "q_lens": [3]})
    assert r.status_code == 200
    out = dec(r.json()["out"])
    torch.testing.assert_close(out.double(), dense_attention(q, k[1], v[1]), atol=1e-5, rtol=1e-5)

    r = c.delete("/v1/sequences/s1")
    assert r.json() == {"seq_id": "s1", "freed_pages": 2}
    pool = c.get("/v1/pool").json()
    assert (pool["pages_used"], pool["pages_cached"], pool["pages_free"]) == (0, 0, 16)
