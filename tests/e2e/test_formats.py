"""POST /v1/step with format=flashinfer|flash_attn against a real server: attention rebuilt in pure
torch from the exported tables over a mirror of the pool matches POST /v1/attend."""

from typing import Any

import torch

from tests.conftest import Server, dec, enc
from tests.e2e.test_walkthrough import dense_attention

L, H, D, P, N = 2, 2, 16, 4, 16  # the conftest small pool
LAYER = 1


class Mirror:
    """What the test wrote into the pool, at the slots the server handed out; every other slot
    holds random garbage, so a table pointing at a wrong page gives a wrong answer."""

    def __init__(self) -> None:
        self.blocks = torch.randn(N + 1, 2, L, P, H, D) * 100

    def write_all_layers(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        for j, slot in enumerate(slots):  # k, v: [L, T, H, D]
            self.blocks[slot // P, 0, :, slot % P] = k[:, j]
            self.blocks[slot // P, 1, :, slot % P] = v[:, j]

    def write_layer(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        for j, slot in enumerate(slots):  # k, v: [T, H, D]
            self.blocks[slot // P, 0, LAYER, slot % P] = k[j]
            self.blocks[slot // P, 1, LAYER, slot % P] = v[j]

    def gather(self, pages: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [length, H, D] of layer LAYER through a page list (the per-layer view [N+1, 2, P, H, D])."""
        layer_view = self.blocks[:, :, LAYER]
        kv = layer_view[torch.tensor(pages, dtype=torch.int64)]  # [npages, 2, P, H, D]
        kv = kv.transpose(0, 1).reshape(2, len(pages) * P, H, D)[:, :length]
        return kv[0], kv[1]


def append(c: Any, mirror: Mirror, seq_id: str, num_tokens: int) -> None:
    k, v = torch.randn(L, num_tokens, H, D), torch.randn(L, num_tokens, H, D)
    r = c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": num_tokens, "k": enc(k), "v": enc(v)})
    assert r.status_code == 200, r.text
    mirror.write_all_layers(r.json()["slots"], k, v)


def decode_step(c: Any, mirror: Mirror, fmt: str) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """One decode token for s1 and s2: step (tables), then attend writing the new token's K/V."""
    r = c.post(
        "/v1/step",
        json={"appends": [{"seq_id": "s1", "num_tokens": 1}, {"seq_id": "s2", "num_tokens": 1}], "format": fmt},
    )
    assert r.status_code == 200, r.text
    step = r.json()
    k, v, q = torch.randn(2, H, D), torch.randn(2, H, D), torch.randn(2, 2 * H, D)
    r = c.post("/v1/attend", json={"layer": LAYER, "seq_ids": ["s1", "s2"], "q": enc(q), "k": enc(k), "v": enc(v)})
    assert r.status_code == 200, r.text
    mirror.write_layer([step["slots"][0][0], step["slots"][1][0]], k, v)
    return step, q, dec(r.json()["out"])


def setup_sequences(c: Any, mirror: Mirror) -> None:
    for seq_id in ("s1", "s2", "s3"):
        assert c.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201
    # Interleaved appends give s1 non-contiguous pages.
    append(c, mirror, "s1", 3)
    append(c, mirror, "s2", 5)
    append(c, mirror, "s1", 4)


def assert_max_fields(step: dict[str, Any], fmt: str) -> None:
    assert step["format"] == fmt
    for key in ("lookup_table", "cache_lengths", "input_lengths", "max_prompt_length", "max_cache_length", "slots"):
        assert key in step
    assert dec(step["cache_lengths"]).tolist() == step_lengths(step)[0]


def step_lengths(step: dict[str, Any]) -> tuple[list[int], list[int]]:
    before = dec(step["cache_lengths"]).to(torch.int64).tolist()
    return before, [b + n for b, n in zip(before, step["input_lengths"])]


def test_flashinfer_then_flash_attn_tables_rebuild_attend(server: Server) -> None:
    c, mirror = server.client, Mirror()
    torch.manual_seed(1)
    setup_sequences(c, mirror)

    step, q, out = decode_step(c, mirror, "flashinfer")
    assert_max_fields(step, "flashinfer")
    indptr, indices, last = (dec(step[k]) for k in ("kv_indptr", "kv_indices", "kv_last_page_len"))
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    # s1: 8 tokens in pages [0, 3] (last page full), s2: 6 tokens in pages [1, 2].
    assert indptr.tolist() == [0, 2, 4] and indices.tolist() == [0, 3, 1, 2] and last.tolist() == [4, 2]
    assert "block_table" not in step
    for i in range(2):
        pages = indices[indptr[i] : indptr[i + 1]].tolist()
        length = (len(pages) - 1) * P + int(last[i])
        k, v = mirror.gather(pages, length)
        expected = dense_attention(q[i : i + 1], k, v)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)

    step, q, out = decode_step(c, mirror, "flash_attn")
    assert_max_fields(step, "flash_attn")
    block_table, seqlens = dec(step["block_table"]), dec(step["cache_seqlens"])
    assert block_table.dtype == seqlens.dtype == torch.int32
    # s1: 9 tokens in pages [0, 3, 4]; s2: 7 tokens in pages [1, 2], then the sentinel (null page).
    assert block_table.tolist() == [[0, 3, 4], [1, 2, N]]
    assert seqlens.tolist() == step_lengths(step)[1] == [9, 7]
    assert "kv_indptr" not in step
    for i in range(2):
        length = int(seqlens[i])
        pages = block_table[i, : -(-length // P)].tolist()
        k, v = mirror.gather(pages, length)
        expected = dense_attention(q[i : i + 1], k, v)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_empty_rows_default_format_and_refusals(server: Server) -> None:
    c, mirror = server.client, Mirror()
    torch.manual_seed(3)
    setup_sequences(c, mirror)
    r = c.post("/v1/step", json={"seq_ids": ["s3", "s2"], "format": "flashinfer"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert dec(body["kv_indptr"]).tolist() == [0, 0, 2]
    assert dec(body["kv_indices"]).tolist() == [1, 2]
    assert dec(body["kv_last_page_len"]).tolist() == [0, 1]
    r = c.post("/v1/step", json={"seq_ids": ["s3", "s2"], "format": "flash_attn"})
    body = r.json()
    assert dec(body["block_table"]).tolist() == [[N, N], [1, 2]]
    assert dec(body["cache_seqlens"]).tolist() == [0, 5]
    body = c.post("/v1/step", json={"seq_ids": ["s2"]}).json()
    assert body["format"] == "max" and "kv_indptr" not in body and "block_table" not in body

    # An unknown format is refused and changes nothing.
    r = c.post("/v1/step", json={"appends": [{"seq_id": "s3", "num_tokens": 3}], "format": "vllm"})
    assert r.status_code == 422
    assert set(r.json()["error"]) == {"code", "message"}
    assert c.get("/v1/sequences/s3").json()["length"] == 0

    # A plain pool still takes k and v together (k alone is an MLA latent).
    r = c.post("/v1/sequences/s3/append", json={"num_tokens": 2, "k": enc(torch.randn(L, 2, H, D))})
    assert r.status_code == 422 and r.json()["error"]["message"] == "k and v come together"
    pool = c.get("/v1/pool").json()
    assert pool["dtype"] == "float32" and pool["mla"] is False and pool["scale_dtype"] is None
