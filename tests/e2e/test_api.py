"""HTTP API v1 against a real `kvpool serve` subprocess (2 layers, 2 KV heads, head_dim 16, 16 pages of 4).

Exact page ids where the pool is fresh; every error code with its envelope and status, and the
state unchanged after it; attention checked against a float64 dense attention of the K/V sent.
"""

import base64
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from service.client import KVPoolClient
from tests.conftest import REPO, SMALL_POOL, Server, dec, enc, free_port

P10 = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]
POOL_FIELDS = {
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "page_size",
    "num_pages",
    "dtype",
    "device",
    "pages_used",
    "pages_cached",
    "pages_free",
    "num_sequences",
    "sentinel",
    "instance_id",
}


@pytest.fixture(scope="module")
def api() -> Iterator[Server]:
    """One small-pool server shared by the tests that do not depend on exact page ids."""
    server = Server(SMALL_POOL)
    yield server
    server.stop()


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q: [Tq, Hq, D], the last Tq positions of k, v: [Tk, Hkv, D]; causal, GQA, float64."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * (1 / math.sqrt(d) if scale is None else scale)
    q_pos = torch.arange(tk - tq, tk)[:, None]
    s = s.masked_fill(torch.arange(tk)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def u32(obj: dict[str, Any]) -> np.ndarray:
    """A uint32 tensor of a response, decoded independently of the service's codec."""
    assert obj["dtype"] == "uint32"
    raw = base64.b64decode(obj["data"])
    return np.frombuffer(raw, dtype="<u4").reshape(obj["shape"])


CODES_WITH_DETAILS = {"out_of_pages", "sequence_not_found", "sequence_exists"}  # their fields as data


def assert_error(r: Any, status: int, code: str, says: str = "") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    fields = {"code", "message", "details"} if code in CODES_WITH_DETAILS else {"code", "message"}
    assert set(body) == {"error"} and set(body["error"]) == fields, body
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    assert isinstance(message, str) and message
    assert says.lower() in message.lower(), message
    return message


def sequence(c: Any, seq_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/sequences/{seq_id}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def pool(c: Any) -> dict[str, Any]:
    body: dict[str, Any] = c.get("/v1/pool").json()
    return body


# -- the walk-through -------------------------------------------------------------------------------
def test_walkthrough_allocate_append_fork_attend_free_and_reuse(server: Server) -> None:
    c = server.client
    p = pool(c)
    assert POOL_FIELDS <= set(p)
    assert {k: p[k] for k in POOL_FIELDS - {"instance_id"}} == {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "page_size": 4,
        "num_pages": 16,
        "dtype": "float32",
        "device": "cpu",
        "pages_used": 0,
        "pages_cached": 0,
        "pages_free": 16,
        "num_sequences": 0,
        "sentinel": 16,
    }
    assert isinstance(p["instance_id"], str) and p["instance_id"]

    r = c.post("/v1/sequences", json={"seq_id": "a", "token_ids": P10})
    assert r.status_code == 201
    assert r.json() == {"seq_id": "a", "length": 0, "block_table": [], "cached_tokens": 0}
    k, v = randn(2, 10, 2, 16, seed=1), randn(2, 10, 2, 16, seed=2)
    r = c.post("/v1/sequences/a/append", json={"num_tokens": 10, "token_ids": P10, "k": enc(k), "v": enc(v)})
    assert r.status_code == 200
    assert r.json() == {
        "seq_id": "a",
        "length": 10,
        "block_table": [0, 1, 2],
        "cached_tokens": 0,
        "slots": list(range(10)),
    }
    assert sequence(c, "a") == {"seq_id": "a", "length": 10, "block_table": [0, 1, 2], "cached_tokens": 0}

    r = c.post("/v1/sequences/a/fork", json={"seq_id": "b"})
    assert r.status_code == 201
    assert r.json() == {"seq_id": "b", "length": 10, "block_table": [0, 1, 2], "cached_tokens": 0}
    p = pool(c)
    assert (p["pages_used"], p["pages_cached"], p["pages_free"], p["num_sequences"]) == (3, 0, 13, 2)

    # b writes into the shared half-full page 2: it gets a copy (page 3), a keeps page 2.
    kb, vb = randn(2, 1, 2, 16, seed=3), randn(2, 1, 2, 16, seed=4)
    r = c.post("/v1/sequences/b/append", json={"num_tokens": 1, "token_ids": [99], "k": enc(kb), "v": enc(vb)})
    assert r.json() == {"seq_id": "b", "length": 11, "block_table": [0, 1, 3], "cached_tokens": 0, "slots": [14]}
    ka, va = randn(2, 1, 2, 16, seed=5), randn(2, 1, 2, 16, seed=6)
    r = c.post("/v1/sequences/a/append", json={"num_tokens": 1, "token_ids": [77], "k": enc(ka), "v": enc(va)})
    assert r.json() == {"seq_id": "a", "length": 11, "block_table": [0, 1, 2], "cached_tokens": 0, "slots": [10]}

    for layer in (0, 1):
        q = randn(5, 4, 16, seed=10 + layer)  # GQA: 4 query heads over 2 KV heads
        r = c.post("/v1/attend", json={"layer": layer, "seq_ids": ["a", "b"], "q": enc(q), "q_lens": [2, 3]})
        assert r.status_code == 200, r.text
        out = dec(r.json()["out"])
        assert out.dtype == torch.float32 and out.shape == (5, 4, 16)
        k_a, v_a = torch.cat([k[layer], ka[layer]]), torch.cat([v[layer], va[layer]])
        k_b, v_b = torch.cat([k[layer], kb[layer]]), torch.cat([v[layer], vb[layer]])
        torch.testing.assert_close(out[:2].double(), dense_attention(q[:2], k_a, v_a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[2:].double(), dense_attention(q[2:], k_b, v_b), atol=1e-5, rtol=1e-5)

    assert c.delete("/v1/sequences/a").json() == {"seq_id": "a", "freed_pages": 1}
    assert c.delete("/v1/sequences/b").json() == {"seq_id": "b", "freed_pages": 3}
    p = pool(c)
    assert (p["pages_used"], p["pages_cached"], p["pages_free"], p["num_sequences"]) == (0, 2, 14, 0)

    # The same prompt again: its two full pages are found in the cache, with their K/V.
    r = c.post("/v1/sequences", json={"seq_id": "c", "token_ids": P10})
    assert r.status_code == 201
    assert r.json() == {"seq_id": "c", "length": 8, "block_table": [0, 1], "cached_tokens": 8}
    q = randn(1, 4, 16, seed=20)
    out = dec(c.post("/v1/attend", json={"layer": 1, "seq_ids": ["c"], "q": enc(q)}).json()["out"])
    torch.testing.assert_close(out.double(), dense_attention(q, k[1, :8], v[1, :8]), atol=1e-5, rtol=1e-5)
    assert c.delete("/v1/sequences/c").json() == {"seq_id": "c", "freed_pages": 2}
    assert_error(c.get("/v1/sequences/c"), 404, "sequence_not_found", "'c'")


# -- step -------------------------------------------------------------------------------------------
def test_step_semantics_and_lookup_tables(server: Server) -> None:
    c = server.client
    for seq_id in ("x", "y", "z"):
        assert c.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201
    assert c.post("/v1/sequences/x/append", json={"num_tokens": 5}).json()["block_table"] == [0, 1]
    assert c.post("/v1/sequences/y/append", json={"num_tokens": 3}).json()["block_table"] == [2]

    body = {
        "appends": [{"seq_id": "y", "num_tokens": 2}, {"seq_id": "x", "num_tokens": 4, "token_ids": [1, 2, 3, 4]}],
        "seq_ids": ["x", "y", "z"],
    }
    r = c.post("/v1/step", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    lut = u32(out["lookup_table"])
    expected = np.full((3, 24), 16, dtype=np.uint32)  # 3 pages at most: 8 * 1 + 16 columns
    expected[0, :3] = [0, 1, 4]
    expected[1, :2] = [2, 3]
    np.testing.assert_array_equal(lut, expected)
    assert u32(out["cache_lengths"]).tolist() == [5, 3, 0]
    assert out["input_lengths"] == [4, 2, 0]
    assert (out["max_prompt_length"], out["max_cache_length"], out["sentinel"]) == (4, 5, 16)
    assert out["slots"] == [[5, 6, 7, 16], [11, 12], []]
    assert sequence(c, "x")["block_table"] == [0, 1, 4] and sequence(c, "x")["length"] == 9
    assert sequence(c, "y")["block_table"] == [2, 3] and sequence(c, "y")["length"] == 5

    # Default rows: the appended sequences, in order.
    out = c.post("/v1/step", json={"appends": [{"seq_id": "z", "num_tokens": 1}]}).json()
    np.testing.assert_array_equal(u32(out["lookup_table"]), [[5] + [16] * 23])
    assert u32(out["cache_lengths"]).tolist() == [0] and out["input_lengths"] == [1]
    assert (out["max_prompt_length"], out["max_cache_length"], out["slots"]) == (1, 0, [[20]])

    # Only listed: nothing appended.
    out = c.post("/v1/step", json={"seq_ids": ["z", "x"]}).json()
    lut = u32(out["lookup_table"])
    assert lut.shape == (2, 24) and lut[0, :1].tolist() == [5] and lut[1, :3].tolist() == [0, 1, 4]
    assert (lut[0, 1:] == 16).all() and (lut[1, 3:] == 16).all()
    assert u32(out["cache_lengths"]).tolist() == [1, 9] and out["input_lengths"] == [0, 0]
    assert (out["max_prompt_length"], out["max_cache_length"], out["slots"]) == (0, 9, [[], []])

    out = c.post("/v1/step", json={}).json()
    assert u32(out["lookup_table"]).shape == (0, 16) and u32(out["cache_lengths"]).shape == (0,)
    assert (out["input_lengths"], out["slots"], out["max_prompt_length"], out["max_cache_length"]) == ([], [], 0, 0)


def test_out_of_pages_changes_nothing(server: Server) -> None:
    c = server.client
    c.post("/v1/sequences", json={"seq_id": "f"})
    c.post("/v1/sequences", json={"seq_id": "g"})
    assert c.post("/v1/sequences/f/append", json={"num_tokens": 60}).status_code == 200
    assert c.post("/v1/sequences/g/append", json={"num_tokens": 3}).json()["block_table"] == [15]
    before, f_before = pool(c), sequence(c, "f")
    assert (before["pages_used"], before["pages_free"]) == (16, 0)
    k, v = randn(2, 1, 2, 16, seed=7), randn(2, 1, 2, 16, seed=8)
    assert_error(
        c.post("/v1/sequences/f/append", json={"num_tokens": 1, "k": enc(k), "v": enc(v)}), 507, "out_of_pages"
    )
    step = {"appends": [{"seq_id": "g", "num_tokens": 1}, {"seq_id": "f", "num_tokens": 1}]}
    assert_error(c.post("/v1/step", json=step), 507, "out_of_pages")
    c.post("/v1/sequences/g/fork", json={"seq_id": "h"})  # shares g's half-full page
    assert_error(c.post("/v1/sequences/h/append", json={"num_tokens": 1}), 507, "out_of_pages")
    assert_error(c.post("/v1/step", json={"appends": [{"seq_id": "g", "num_tokens": 1}]}), 507, "out_of_pages")
    assert c.delete("/v1/sequences/h").json() == {"seq_id": "h", "freed_pages": 0}
    assert pool(c) == before and sequence(c, "f") == f_before
    assert sequence(c, "g") == {"seq_id": "g", "length": 3, "block_table": [15], "cached_tokens": 0}
    assert c.post("/v1/step", json={"appends": [{"seq_id": "g", "num_tokens": 1}]}).json()["slots"] == [[63]]


# -- attention --------------------------------------------------------------------------------------
def test_attend_writes_k_v_of_the_query_positions_first(api: Server) -> None:
    c = api.client
    c.post("/v1/sequences", json={"seq_id": "w"})
    c.post("/v1/sequences", json={"seq_id": "u"})
    prompt_k, prompt_v = randn(2, 5, 2, 16, seed=30), randn(2, 5, 2, 16, seed=31)
    c.post("/v1/sequences/w/append", json={"num_tokens": 5, "k": enc(prompt_k), "v": enc(prompt_v)})
    c.post("/v1/step", json={"appends": [{"seq_id": "w", "num_tokens": 3}, {"seq_id": "u", "num_tokens": 2}]})
    keys = {"w": [prompt_k[0], prompt_k[1]], "u": [torch.empty(0, 2, 16)] * 2}
    values = {"w": [prompt_v[0], prompt_v[1]], "u": [torch.empty(0, 2, 16)] * 2}
    for layer in (0, 1):  # a prefill chunk of 3 tokens for w, 2 for u, written by attend itself
        q = randn(5, 4, 16, seed=40 + layer)
        k, v = randn(5, 2, 16, seed=50 + layer), randn(5, 2, 16, seed=60 + layer)
        body: dict[str, Any] = {
            "layer": layer,
            "seq_ids": ["w", "u"],
            "q": enc(q),
            "q_lens": [3, 2],
            "k": enc(k),
            "v": enc(v),
        }
        r = c.post("/v1/attend", json=body)
        assert r.status_code == 200, r.text
        out = dec(r.json()["out"])
        keys["w"][layer] = torch.cat([keys["w"][layer], k[:3]])
        values["w"][layer] = torch.cat([values["w"][layer], v[:3]])
        keys["u"][layer], values["u"][layer] = k[3:], v[3:]
        expected_w = dense_attention(q[:3], keys["w"][layer], values["w"][layer])
        expected_u = dense_attention(q[3:], keys["u"][layer], values["u"][layer])
        torch.testing.assert_close(out[:3].double(), expected_w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[3:].double(), expected_u, atol=1e-5, rtol=1e-5)
    # Decode over what was written, with a given scale and 2 query heads per KV head.
    for layer in (0, 1):
        q = randn(2, 4, 16, seed=70 + layer)
        body = {"layer": layer, "seq_ids": ["u", "w"], "q": enc(q), "scale": 0.3}
        out = dec(c.post("/v1/attend", json=body).json()["out"])
        expected = [dense_attention(q[i : i + 1], keys[s][layer], values[s][layer], 0.3) for i, s in enumerate("uw")]
        torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
    for seq_id in ("w", "u"):
        assert c.delete(f"/v1/sequences/{seq_id}").status_code == 200


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tensors_round_trip(api: Server, dtype: torch.dtype) -> None:
    c = api.client
    seq_id = f"round-trip.{str(dtype)[6:]}"
    k, v = randn(2, 1, 2, 16, seed=80, dtype=dtype), randn(2, 1, 2, 16, seed=81, dtype=dtype)
    c.post("/v1/sequences", json={"seq_id": seq_id})
    assert c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": 1, "k": enc(k), "v": enc(v)}).status_code == 200
    for layer in (0, 1):
        q = randn(1, 4, 16, seed=82, dtype=dtype)
        r = c.post("/v1/attend", json={"layer": layer, "seq_ids": [seq_id], "q": enc(q)})
        body = r.json()["out"]
        assert body["dtype"] == str(dtype)[6:] and body["shape"] == [1, 4, 16]
        # One position: the softmax is 1 and the output is v itself, for both query heads of a KV head.
        torch.testing.assert_close(dec(body), v[layer].repeat_interleave(2, dim=1), atol=0, rtol=0)
    c.delete(f"/v1/sequences/{seq_id}")


# -- ids --------------------------------------------------------------------------------------------
def test_generated_ids_and_id_conflicts(api: Server) -> None:
    c = api.client
    r = c.post("/v1/sequences", json={})
    assert r.status_code == 201
    generated = r.json()["seq_id"]
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", generated)
    assert sequence(c, generated)["length"] == 0
    r = c.post(f"/v1/sequences/{generated}/fork")
    assert r.status_code == 201 and r.json()["seq_id"] not in (generated, "")
    child = r.json()["seq_id"]
    assert re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", child)
    c.post("/v1/sequences", json={"seq_id": "taken"})
    before = pool(c)
    assert_error(c.post("/v1/sequences", json={"seq_id": "taken"}), 409, "sequence_exists", "'taken'")
    assert_error(c.post(f"/v1/sequences/{generated}/fork", json={"seq_id": "taken"}), 409, "sequence_exists")
    assert pool(c) == before
    for seq_id in (generated, child, "taken"):
        assert c.delete(f"/v1/sequences/{seq_id}").status_code == 200


def test_sequence_answers_name_the_instance_only_when_asked(api: Server) -> None:
    c = api.client
    instance = pool(c)["instance_id"]
    assert c.post("/v1/sequences", json={"seq_id": "inst"}).status_code == 201
    r = c.post("/v1/sequences/inst/append?instance=true", json={"num_tokens": 2})
    assert r.status_code == 200 and r.json()["instance_id"] == instance and r.json()["length"] == 2
    r = c.post("/v1/sequences/inst/append", json={"num_tokens": 1})
    assert r.status_code == 200 and "instance_id" not in r.json() and r.json()["length"] == 3
    plain = sequence(c, "inst")
    assert "instance_id" not in plain and plain["length"] == 3
    r = c.get("/v1/sequences/inst?instance=true")
    assert r.status_code == 200 and r.json() == {**plain, "instance_id": instance}
    assert_error(c.get("/v1/sequences/inst?instance=maybe"), 422, "invalid_request")
    assert_error(c.get("/v1/sequences/missing?instance=true"), 404, "sequence_not_found")
    with KVPoolClient(api.url) as client:  # the client parses the field when it asks for it, None otherwise
        assert client.get_sequence("inst", instance=True).instance_id == instance
        assert client.get_sequence("inst").instance_id is None
        appended = client.append("inst", 1, instance=True)
        assert (appended.instance_id, appended.length) == (instance, 4)
        step = client.step([("inst", 2)], instance=True)  # a step's answer too (the vLLM connector's batched saves)
        assert step.instance_id == instance and step.cache_lengths.tolist() == [4] and step.input_lengths == [2]
        assert client.step([("inst", 1)]).instance_id is None
    r = c.post("/v1/step?instance=true", json={"appends": [{"seq_id": "inst", "num_tokens": 1}]})
    assert r.status_code == 200 and r.json()["instance_id"] == instance
    assert "instance_id" not in c.post("/v1/step", json={"appends": []}).json()
    assert_error(c.post("/v1/step?instance=maybe", json={"appends": []}), 422, "invalid_request")
    assert sequence(c, "inst")["length"] == 8
    assert c.delete("/v1/sequences/inst").status_code == 200


# -- errors -----------------------------------------------------------------------------------------
def tensor(shape: list[int], dtype: str = "float32", nbytes: int | None = None, data: str | None = None) -> dict:
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "float64": 8}[dtype]
    n = math.prod(shape) * itemsize if nbytes is None else nbytes
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(raw).decode() if data is None else data}


KV2 = tensor([2, 2, 2, 16])  # [num_layers, num_tokens=2, num_kv_heads, head_dim]
Q1 = tensor([1, 4, 16])
INVALID = {
    "extra field": ("POST", "/v1/sequences", {"seq_id": "n1", "extra": 1}, "extra"),
    "token_ids not a list": ("POST", "/v1/sequences", {"token_ids": "abc"}, "token_ids"),
    "negative token id": ("POST", "/v1/sequences", {"token_ids": [-1, 2]}, "token_ids"),
    "seq_id with a space": ("POST", "/v1/sequences", {"seq_id": "has space"}, "seq_id"),
    "empty seq_id": ("POST", "/v1/sequences", {"seq_id": ""}, "seq_id"),
    "seq_id of 129 chars": ("POST", "/v1/sequences", {"seq_id": "x" * 129}, "seq_id"),
    "body not JSON": ("POST", "/v1/sequences", b"{not json", "json"),
    "bad seq_id in path (get)": ("GET", "/v1/sequences/bad!id", None, "seq_id"),
    "bad seq_id in path (append)": ("POST", f"/v1/sequences/{'y' * 129}/append", {"num_tokens": 1}, "seq_id"),
    "bad seq_id in path (delete)": ("DELETE", "/v1/sequences/bad!id", None, "seq_id"),
    "bad seq_id in fork body": ("POST", "/v1/sequences/e/fork", {"seq_id": "bad id"}, "seq_id"),
    "num_tokens 0": ("POST", "/v1/sequences/e/append", {"num_tokens": 0}, "num_tokens"),
    "num_tokens not a number": ("POST", "/v1/sequences/e/append", {"num_tokens": "two"}, "num_tokens"),
    "token_ids length": ("POST", "/v1/sequences/e/append", {"num_tokens": 2, "token_ids": [1]}, "token_ids"),
    "k without v": ("POST", "/v1/sequences/e/append", {"num_tokens": 2, "k": KV2}, "k and v"),
    "k shape": (
        "POST",
        "/v1/sequences/e/append",
        {"num_tokens": 2, "k": tensor([2, 3, 2, 16]), "v": tensor([2, 3, 2, 16])},
        "shape",
    ),
    "k dtype int32": (
        "POST",
        "/v1/sequences/e/append",
        {"num_tokens": 2, "k": tensor([2, 2, 2, 16], "int32"), "v": tensor([2, 2, 2, 16], "int32")},
        "floating",
    ),
    "k dtype float64": (
        "POST",
        "/v1/sequences/e/append",
        {"num_tokens": 2, "k": tensor([2, 2, 2, 16], "float64"), "v": tensor([2, 2, 2, 16], "float64")},
        "dtype",
    ),
    "k byte count": (
        "POST",
        "/v1/sequences/e/append",
        {"num_tokens": 2, "k": KV2, "v": tensor([2, 2, 2, 16], nbytes=100)},
        "bytes",
    ),
    "k bad base64": (
        "POST",
        "/v1/sequences/e/append",
        {"num_tokens": 2, "k": KV2, "v": tensor([2, 2, 2, 16], data="@@not base64@@")},
        "base64",
    ),
    "layer out of range": ("POST", "/v1/attend", {"layer": 2, "seq_ids": ["e"], "q": Q1}, "layer"),
    "negative layer": ("POST", "/v1/attend", {"layer": -1, "seq_ids": ["e"], "q": Q1}, "layer"),
    "q_len above the length": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e"], "q": tensor([3, 4, 16]), "q_lens": [3]},
        "exceeds",
    ),
    "q heads not a multiple of kv heads": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e"], "q": tensor([1, 3, 16])},
        "multiple",
    ),
    "q_lens not adding up": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e"], "q": tensor([2, 4, 16]), "q_lens": [1]},
        "q_lens",
    ),
    "attend k without v": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e"], "q": Q1, "k": tensor([1, 2, 16])},
        "k and v",
    ),
    "attend k shape": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e"], "q": Q1, "k": tensor([2, 2, 16]), "v": tensor([2, 2, 16])},
        "shape",
    ),
    "duplicate seq in attend": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e", "e"], "q": tensor([2, 4, 16])},
        "distinct",
    ),
    "q dtype int32": ("POST", "/v1/attend", {"layer": 0, "seq_ids": ["e"], "q": tensor([1, 4, 16], "int32")}, "float"),
    "negative tensor dim": (
        "POST",
        "/v1/attend",
        {"layer": 0, "seq_ids": ["e"], "q": {**Q1, "shape": [1, -4, 16]}},
        "shape",
    ),
    "token id of 2**63": ("POST", "/v1/sequences", {"token_ids": [1, 2**63]}, "token_ids"),
    "body a JSON array": ("POST", "/v1/sequences", [1, 2], ""),
    "duplicate seq in step": (
        "POST",
        "/v1/step",
        {"appends": [{"seq_id": "e", "num_tokens": 1}, {"seq_id": "e", "num_tokens": 1}]},
        "once",
    ),
    "step token_ids length": (
        "POST",
        "/v1/step",
        {"appends": [{"seq_id": "e", "num_tokens": 2, "token_ids": [5]}]},
        "token_ids",
    ),
    "bad seq_id in step": ("POST", "/v1/step", {"appends": [{"seq_id": "a/b", "num_tokens": 1}]}, "seq_id"),
    "bad seq_id in step rows": ("POST", "/v1/step", {"seq_ids": ["a b"]}, "seq_id"),
}


@pytest.fixture(scope="module")
def probe(api: Server) -> Iterator[dict[str, Any]]:
    """Sequence `e` (2 tokens written) whose state every failed request must leave as it was."""
    c = api.client
    c.post("/v1/sequences", json={"seq_id": "e", "token_ids": [1, 2]})
    k, v = randn(2, 2, 2, 16, seed=90), randn(2, 2, 2, 16, seed=91)
    c.post("/v1/sequences/e/append", json={"num_tokens": 2, "token_ids": [1, 2], "k": enc(k), "v": enc(v)})
    yield {"k": k, "v": v}
    c.delete("/v1/sequences/e")


def observe(c: Any) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    """Pool counts, sequence e, and an attention over e's K/V (which a failed write must not touch)."""
    q = randn(2, 4, 16, seed=92)
    out = c.post("/v1/attend", json={"layer": 1, "seq_ids": ["e"], "q": enc(q), "q_lens": [2]})
    return pool(c), sequence(c, "e"), dec(out.json()["out"])


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_get_422_and_change_nothing(api: Server, probe: dict[str, Any], case: str) -> None:
    method, path, body, says = INVALID[case]
    c = api.client
    before = observe(c)
    if isinstance(body, bytes):
        r = c.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = c.request(method, path, json=body)
    assert_error(r, 422, "invalid_request", says)
    after = observe(c)
    assert after[:2] == before[:2]
    torch.testing.assert_close(after[2], before[2], atol=0, rtol=0)


NOT_FOUND = {
    "get": ("GET", "/v1/sequences/ghost", None),
    "append": ("POST", "/v1/sequences/ghost/append", {"num_tokens": 1}),
    "fork": ("POST", "/v1/sequences/ghost/fork", {"seq_id": "ghost2"}),
    "delete": ("DELETE", "/v1/sequences/ghost", None),
    "step append": (
        "POST",
        "/v1/step",
        {"appends": [{"seq_id": "e", "num_tokens": 1}, {"seq_id": "ghost", "num_tokens": 1}]},
    ),
    "step rows": ("POST", "/v1/step", {"appends": [{"seq_id": "e", "num_tokens": 1}], "seq_ids": ["e", "ghost"]}),
    "attend": ("POST", "/v1/attend", {"layer": 0, "seq_ids": ["e", "ghost"], "q": tensor([2, 4, 16])}),
}


@pytest.mark.parametrize("case", list(NOT_FOUND))
def test_unknown_sequences_get_404_and_change_nothing(api: Server, probe: dict[str, Any], case: str) -> None:
    method, path, body = NOT_FOUND[case]
    c = api.client
    before = observe(c)
    assert_error(c.request(method, path, json=body), 404, "sequence_not_found", "'ghost'")
    after = observe(c)
    assert after[:2] == before[:2]


def test_unknown_routes_and_wrong_methods_get_the_envelope(api: Server) -> None:
    c = api.client
    assert_error(c.get("/v1/nothing-here"), 404, "not_found")
    assert_error(c.post("/v2/sequences", json={}), 404, "not_found")
    assert_error(c.delete("/v1/pool"), 405, "method_not_allowed")
    assert_error(c.get("/v1/step"), 405, "method_not_allowed")
    assert_error(c.put("/v1/sequences/e", json={}), 405, "method_not_allowed")


def test_health_and_readiness(api: Server) -> None:
    c = api.client
    r = c.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = c.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert r.json()["instance_id"] == pool(c)["instance_id"]


# -- starting ---------------------------------------------------------------------------------------
def test_flags_override_the_environment_and_each_start_has_its_own_instance_id(start_server: Any) -> None:
    wide = start_server(args=["--num-pages", "32"])
    p = pool(wide.client)
    assert (p["num_pages"], p["sentinel"], p["pages_free"], p["dtype"]) == (32, 32, 32, "float32")
    bf16 = start_server({"KVPOOL_DTYPE": "bfloat16"})
    q = pool(bf16.client)
    assert (q["num_pages"], q["dtype"]) == (16, "bfloat16")
    assert p["instance_id"] != q["instance_id"]
    # A bfloat16 pool stores bfloat16 K/V exactly.
    c = bf16.client
    k, v = randn(2, 1, 2, 16, seed=95, dtype=torch.bfloat16), randn(2, 1, 2, 16, seed=96, dtype=torch.bfloat16)
    c.post("/v1/sequences", json={"seq_id": "s"})
    c.post("/v1/sequences/s/append", json={"num_tokens": 1, "k": enc(k), "v": enc(v)})
    q_in = randn(1, 2, 16, seed=97, dtype=torch.bfloat16)
    out = dec(c.post("/v1/attend", json={"layer": 1, "seq_ids": ["s"], "q": enc(q_in)}).json()["out"])
    torch.testing.assert_close(out, v[1], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("env", "args", "names"),
    [
        ({"KVPOOL_PAGE_SIZE": "0"}, [], "KVPOOL_PAGE_SIZE"),
        ({"KVPOOL_DEVICE": "tpu"}, [], "KVPOOL_DEVICE"),
        ({"KVPOOL_DTYPE": "float64"}, [], "KVPOOL_DTYPE"),
        ({"KVPOOL_NUM_PAGES": "many"}, [], "KVPOOL_NUM_PAGES"),
        ({}, ["--head-dim", "0"], "KVPOOL_HEAD_DIM"),
    ],
)
def test_a_bad_setting_stops_the_server_with_a_message_naming_it(
    env: dict[str, str], args: list[str], names: str
) -> None:
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(free_port()), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **SMALL_POOL, **env}
    done = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert names in done.stderr, done.stderr
