"""Leases against a real server: a sequence nobody names for ttl_s seconds is freed by the sweeper.

Waits are short (ttl 1 s, sweeps every 0.1 s); renewals come every 0.2 s, well inside the lease.
Expiry is observed through GET /v1/pool, which names no sequence and so renews nothing.
"""

import time
from typing import Any

import httpx
import torch

from tests.conftest import Server, enc

SWEEP = {"KVPOOL_LEASE_SWEEP_INTERVAL_S": "0.1"}


def used_pages(c: httpx.Client) -> int:
    return int(c.get("/v1/pool").json()["pages_used"])


def wait_for_used_pages(c: httpx.Client, expected: int, timeout: float = 10.0) -> float:
    """Polls until pages_used == expected; returns the monotonic time it was first seen."""
    deadline = time.monotonic() + timeout
    while used_pages(c) != expected:
        assert time.monotonic() < deadline, f"pages_used did not reach {expected} in {timeout} s"
        time.sleep(0.05)
    return time.monotonic()


def keep_alive(renew: list[Any], seconds: float) -> float:
    """Calls every function in `renew` every 0.2 s for `seconds`; returns when the last renewal answered."""
    end = time.monotonic() + seconds
    last = time.monotonic()
    while time.monotonic() < end:
        for call in renew:
            r = call()
            assert r.status_code in (200, 201), r.text
        last = time.monotonic()
        time.sleep(0.2)
    return last


def test_a_lease_is_renewed_by_use_and_freed_when_use_stops(start_server: Any) -> None:
    server: Server = start_server(SWEEP)
    c = server.client
    torch.manual_seed(7)
    r = c.post("/v1/sequences", json={"seq_id": "leased", "ttl_s": 1.0})
    assert r.status_code == 201
    body = r.json()
    assert body["ttl_s"] == 1.0 and 0.5 < body["expires_in_s"] <= 1.0
    k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)
    r = c.post("/v1/sequences/leased/append", json={"num_tokens": 6, "k": enc(k), "v": enc(v)})
    assert r.json()["block_table"] == [0, 1] and r.json()["ttl_s"] == 1.0
    kept = c.post("/v1/sequences", json={"seq_id": "kept"}).json()
    assert "ttl_s" not in kept and "expires_in_s" not in kept  # no lease: the body keeps its plain shape
    c.post("/v1/sequences/kept/append", json={"num_tokens": 3})

    # 2.5 s of use (well past the 1 s lease): GET and attend renew it.
    q = torch.randn(1, 4, 16)
    last = keep_alive(
        [
            lambda: c.get("/v1/sequences/leased"),
            lambda: c.post("/v1/attend", json={"layer": 0, "seq_ids": ["leased"], "q": enc(q)}),
        ],
        2.5,
    )
    assert used_pages(c) == 3
    gone = wait_for_used_pages(c, 1)
    assert gone - last >= 0.9  # not before the lease ran out (less the latency of the last answer)
    assert c.get("/v1/sequences/leased").json()["error"]["code"] == "sequence_not_found"
    assert c.get("/v1/sequences/kept").json()["length"] == 3
    pool = c.get("/v1/pool").json()
    assert (pool["pages_used"], pool["pages_cached"], pool["pages_free"], pool["num_sequences"]) == (1, 0, 15, 1)
    check_a_bad_ttl_is_refused_and_creates_nothing(c)  # on the same server, to save a start


def test_the_default_lease_a_fork_inheriting_it_and_step_renewals(start_server: Any) -> None:
    server: Server = start_server({**SWEEP, "KVPOOL_DEFAULT_TTL_S": "1.0"})
    c = server.client
    assert c.post("/v1/sequences", json={"seq_id": "parent"}).json()["ttl_s"] == 1.0
    assert "ttl_s" not in c.post("/v1/sequences", json={"seq_id": "pinned", "ttl_s": 0}).json()
    c.post("/v1/sequences/parent/append", json={"num_tokens": 6})  # pages 0, 1
    c.post("/v1/sequences/pinned/append", json={"num_tokens": 1})  # page 2
    child = c.post("/v1/sequences/parent/fork", json={"seq_id": "child"}).json()
    assert child["ttl_s"] == 1.0 and child["block_table"] == [0, 1]

    # The parent is renewed by the appends of a step, the child by being listed in one.
    step = {"appends": [{"seq_id": "parent", "num_tokens": 1}], "seq_ids": ["parent", "child"]}
    keep_alive([lambda: c.post("/v1/step", json=step)], 2.0)
    lengths = [c.get(f"/v1/sequences/{s}").json()["length"] for s in ("parent", "child")]
    assert lengths[0] > 6 + 5 and lengths[1] == 6

    # Now only the child is named; the parent runs out, its pages shared with the child stay.
    c.post("/v1/step", json={"seq_ids": ["child"]})
    keep_alive([lambda: c.post("/v1/step", json={"seq_ids": ["child"]})], 1.6)
    assert c.get("/v1/sequences/parent").status_code == 404
    assert c.get("/v1/sequences/child").json()["block_table"] == [0, 1]
    wait_for_used_pages(c, 1)  # then the child goes too; the pinned sequence stays
    assert c.get("/v1/sequences/child").status_code == 404
    assert c.get("/v1/sequences/pinned").json()["length"] == 1


def check_a_bad_ttl_is_refused_and_creates_nothing(c: httpx.Client) -> None:
    for ttl in (-1, "soon", 1e300, None):
        r = c.post("/v1/sequences", json={"seq_id": "bad", "ttl_s": ttl})
        if ttl is None:  # null means "the default" (here: no lease)
            assert r.status_code == 201 and "ttl_s" not in r.json()
            c.delete("/v1/sequences/bad")
            continue
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
        assert "ttl_s" in r.json()["error"]["message"]
    assert c.get("/v1/sequences/bad").status_code == 404
    assert c.get("/v1/pool").json()["num_sequences"] == 1
