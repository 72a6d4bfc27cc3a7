"""Issue 13's findings 3, 5, 6 and 7, each reproduced against a real `kvpool serve` and now refused:
one huge attend (a cap on its work, refused before any), sequence ids that a URL resolves away,
leases that refused calls did not renew, and values float32 cannot hold (scale, softcap, a NaN q),
with step's repeated seq_ids beside attend's.
"""

import time
from typing import Any

import httpx
import numpy as np
import torch

from tests.conftest import Server, dec, enc

SWEEP = {"KVPOOL_LEASE_SWEEP_INTERVAL_S": "0.1"}


def pool_state(c: httpx.Client, seq_ids: list[str]) -> tuple[Any, ...]:
    """The pool's counts and each named sequence's length and pages (None for one that is gone)."""
    pool = c.get("/v1/pool").json()
    counts = tuple(pool[k] for k in ("pages_used", "pages_cached", "pages_free", "num_sequences"))
    seqs = []
    for seq_id in seq_ids:
        r = c.get(f"/v1/sequences/{seq_id}")
        seqs.append((r.json()["length"], r.json()["block_table"]) if r.status_code == 200 else None)
    return counts, seqs


def refused(r: httpx.Response, code: str = "invalid_request", status: int = 422) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == code, error
    return error


# -- finding 3: one big attend -------------------------------------------------------------------
def test_an_attend_over_the_default_cpu_cap_is_refused_at_once_and_changes_nothing(start_server: Any) -> None:
    """2,049 queries over a 2,049-token sequence: 2,049^2 pairs, just over the CPU default 2^22.
    Refused before any work: in far less time than the attention would take (seconds with a real
    model's heads), with the given K/V not written."""
    tokens, heads, dim = 2049, 1, 16
    server: Server = start_server(
        {
            "KVPOOL_NUM_LAYERS": "1",
            "KVPOOL_NUM_KV_HEADS": str(heads),
            "KVPOOL_HEAD_DIM": str(dim),
            "KVPOOL_PAGE_SIZE": "16",
            "KVPOOL_NUM_PAGES": "160",
        }
    )
    c = server.client
    assert c.get("/v1/pool").json()["max_attend_tokens"] == 2**22
    c.post("/v1/sequences", json={"seq_id": "long"})
    rng = np.random.default_rng(3)
    k, v = (torch.from_numpy(rng.standard_normal((1, tokens, heads, dim), dtype=np.float32)) for _ in range(2))
    assert c.post("/v1/sequences/long/append", json={"num_tokens": tokens, "k": enc(k), "v": enc(v)}).status_code == 200
    q = torch.from_numpy(rng.standard_normal((tokens, 4, dim), dtype=np.float32))
    one = {"layer": 0, "seq_ids": ["long"], "q": enc(q[-1:])}
    before_out = c.post("/v1/attend", json=one).json()["out"]
    before = pool_state(c, ["long"])

    # The new K/V would overwrite the sequence's last `tokens` positions: all of them.
    big = {"layer": 0, "seq_ids": ["long"], "q": enc(q), "q_lens": [tokens], "k": enc(-k[0]), "v": enc(-v[0])}
    started = time.monotonic()
    error = refused(c.post("/v1/attend", json=big), "attend_too_large")
    elapsed = time.monotonic() - started
    assert error["details"] == {"tokens": tokens * tokens, "limit": 2**22}
    assert "KVPOOL_MAX_ATTEND_TOKENS" in error["message"]
    assert elapsed < 1.0, f"the refusal took {elapsed:.2f} s"
    assert pool_state(c, ["long"]) == before
    assert c.post("/v1/attend", json=one).json()["out"] == before_out  # K/V unchanged, bit for bit


def test_the_cap_is_a_setting_and_counts_queries_times_context_over_every_sequence(start_server: Any) -> None:
    server: Server = start_server({"KVPOOL_MAX_ATTEND_TOKENS": "100"})
    c = server.client
    assert c.get("/v1/pool").json()["max_attend_tokens"] == 100
    for seq_id, n in (("a", 8), ("b", 6)):
        c.post("/v1/sequences", json={"seq_id": seq_id})
        c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": n})
    q = torch.randn(14, 4, 16)
    # q_len x length summed: 8 x 8 + 4 x 6 = 88, then 8 x 8 + 6 x 6 = 100 (at the cap): both accepted
    for q_lens, status in (([8, 4], 200), ([8, 6], 200)):
        body = {"layer": 0, "seq_ids": ["a", "b"], "q": enc(q[: sum(q_lens)]), "q_lens": q_lens}
        assert c.post("/v1/attend", json=body).status_code == status
    c.post("/v1/sequences/b/append", json={"num_tokens": 1})  # b: 7 tokens; 8 x 8 + 6 x 7 = 106
    body = {"layer": 0, "seq_ids": ["a", "b"], "q": enc(q), "q_lens": [8, 6]}
    assert refused(c.post("/v1/attend", json=body), "attend_too_large")["details"] == {"tokens": 106, "limit": 100}


# -- finding 5: ids a URL resolves away ------------------------------------------------------------
def test_dot_segment_ids_are_refused_and_every_other_id_round_trips_in_a_url(server: Server) -> None:
    c = server.client
    before = pool_state(c, [])
    for seq_id in (".", ".."):
        assert "seq_id" in refused(c.post("/v1/sequences", json={"seq_id": seq_id}))["message"]
        c.post("/v1/sequences", json={"seq_id": "parent"})
        refused(c.post("/v1/sequences/parent/fork", json={"seq_id": seq_id}))
        c.delete("/v1/sequences/parent")
        refused(c.post("/v1/step", json={"appends": [{"seq_id": seq_id, "num_tokens": 1}]}))
    assert pool_state(c, []) == before
    # Every other id of the alphabet is one URL path segment as it is: created, reached, freed.
    for seq_id in ("...", ".a", "..a", "a.", "a..", "a:b", ":", "-", "_", "a.b-c_d:e", "." * 128):
        assert c.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201, seq_id
        r = c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": 1})
        assert r.status_code == 200 and r.json()["seq_id"] == seq_id, (seq_id, r.text)
        assert c.get(f"/v1/sequences/{seq_id}").json()["length"] == 1
        assert c.delete(f"/v1/sequences/{seq_id}").json() == {"seq_id": seq_id, "freed_pages": 1}
    assert pool_state(c, [])[0][3] == 0


# -- finding 6: refused calls renew leases ---------------------------------------------------------
def test_refused_calls_naming_a_sequence_renew_its_lease(start_server: Any) -> None:
    """Each leased sequence (ttl 1 s) is named only by calls that are refused, every 0.2 s for 2.5 s:
    all outlive their lease; a sequence nobody names is freed meanwhile; once the calls stop, all go."""
    server: Server = start_server(SWEEP)
    c = server.client
    names = ["zero", "nan-k", "layer-99", "bad-step", "step-404", "idle"]
    for seq_id in names:
        assert c.post("/v1/sequences", json={"seq_id": seq_id, "ttl_s": 1.0}).status_code == 201
        c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": 2})
    nan_k = torch.randn(2, 1, 2, 16)
    nan_k[1, 0, 1, 3] = float("nan")
    q = torch.randn(1, 4, 16)
    nan_append = {"num_tokens": 1, "k": enc(nan_k), "v": enc(-nan_k.nan_to_num())}
    step_404 = {"appends": [{"seq_id": "ghost", "num_tokens": 1}], "seq_ids": ["step-404"]}
    calls = {
        "zero": lambda: c.post("/v1/sequences/zero/append", json={"num_tokens": 0}),
        "nan-k": lambda: c.post("/v1/sequences/nan-k/append", json=nan_append),
        "layer-99": lambda: c.post("/v1/attend", json={"layer": 99, "seq_ids": ["layer-99"], "q": enc(q)}),
        "bad-step": lambda: c.post("/v1/step", json={"seq_ids": ["bad-step"], "format": "nope"}),
        "step-404": lambda: c.post("/v1/step", json=step_404),
    }
    expected = {"zero": 422, "nan-k": 422, "layer-99": 422, "bad-step": 422, "step-404": 404}
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        for seq_id, call in calls.items():
            r = call()
            assert r.status_code == expected[seq_id], (seq_id, r.text)
            assert "error" in r.json()
        time.sleep(0.2)
    assert c.get("/v1/pool").json()["num_sequences"] == len(calls)  # "idle" expired, the others did not
    lengths = {s: c.get(f"/v1/sequences/{s}").json()["length"] for s in calls}  # (GET renews too)
    assert lengths == dict.fromkeys(calls, 2)  # every refused call changed nothing
    deadline = time.monotonic() + 10
    while c.get("/v1/pool").json()["num_sequences"]:
        assert time.monotonic() < deadline, "the leases did not run out once nothing named them"
        time.sleep(0.05)
    assert c.get("/v1/pool").json()["pages_used"] == 0


# -- finding 7: values float32 cannot hold; repeats -------------------------------------------------
def test_attention_values_float32_cannot_hold_and_a_non_finite_q_are_refused(server: Server) -> None:
    c = server.client
    c.post("/v1/sequences", json={"seq_id": "s"})
    k, v = torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
    c.post("/v1/sequences/s/append", json={"num_tokens": 5, "k": enc(k), "v": enc(v)})
    q = torch.randn(1, 4, 16)
    base = {"layer": 0, "seq_ids": ["s"], "q": enc(q)}
    plain = c.post("/v1/attend", json=base).json()["out"]
    before = pool_state(c, ["s"])
    bad = [
        {"scale": 1e39},
        {"scale": 1e-50},  # zero in float32
        {"softcap": 1e300},
        {"softcap": 1e-39},  # subnormal in float32
        {"sliding_window": 2**31},
        {"sliding_window": 2**70},
    ]
    for extra in bad:
        name = next(iter(extra))
        assert name in refused(c.post("/v1/attend", json={**base, **extra}))["message"], extra
    for value in (float("nan"), float("inf"), float("-inf")):
        bad_q = q.clone()
        bad_q[0, 2, 7] = value
        # K/V for the query's position come with it: a refusal must not write them.
        body = {**base, "q": enc(bad_q), "k": enc(-k[0, -1:]), "v": enc(-v[0, -1:])}
        assert refused(c.post("/v1/attend", json=body))["message"] == "q has NaN or infinite values"
    assert pool_state(c, ["s"]) == before
    assert c.post("/v1/attend", json=base).json()["out"] == plain  # nothing was written
    # The largest values that are float32 still run, and give finite outputs.
    for extra in ({"scale": 1.2e-38, "softcap": 3.4e38}, {"sliding_window": 2**31 - 1}):
        r = c.post("/v1/attend", json={**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert torch.isfinite(dec(r.json()["out"])).all()


def two_sequences(c: httpx.Client) -> tuple[Any, ...]:
    """Sequences a and b of 3 tokens each; the pool's state then (pool_state)."""
    for seq_id in ("a", "b"):
        c.post("/v1/sequences", json={"seq_id": seq_id})
        c.post(f"/v1/sequences/{seq_id}/append", json={"num_tokens": 3})
    return pool_state(c, ["a", "b"])


def test_a_step_refuses_a_repeated_seq_id_as_attend_does_and_changes_nothing(server: Server) -> None:
    c = server.client
    before = two_sequences(c)
    step = {"appends": [{"seq_id": "a", "num_tokens": 2}], "seq_ids": ["a", "b", "a"]}
    step_error = refused(c.post("/v1/step", json=step))
    q = torch.randn(2, 4, 16)
    attend_error = refused(c.post("/v1/attend", json={"layer": 0, "seq_ids": ["a", "a"], "q": enc(q)}))
    assert step_error["message"] == attend_error["message"] == "seq_ids must be distinct: 'a' is named more than once"
    assert pool_state(c, ["a", "b"]) == before  # the step's append did not happen


def test_a_step_that_frees_a_missing_sequence_is_refused_whole(server: Server) -> None:
    c = server.client
    before = two_sequences(c)
    answer = c.post("/v1/step", json={"appends": [{"seq_id": "a", "num_tokens": 2}], "free": ["b", "gone"]})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "sequence_not_found"
    overlap = refused(c.post("/v1/step", json={"appends": [{"seq_id": "a", "num_tokens": 2}], "free": ["a"]}))
    assert overlap["message"] == "a sequence freed by a step may not also be appended or listed in it"
    assert pool_state(c, ["a", "b"]) == before  # neither the append nor b's free happened
