"""SIGTERM against a real server: /readyz turns 503 at once, in-flight requests finish, the process exits 0.

The in-flight request is an attend whose body the test holds back (a chunked upload paused
half-way): it is in flight for exactly as long as the test wants, with no timing guesswork.
"""

import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from tests.conftest import Server, dec, enc

GRACE_S = 1.0


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [Hq, D] for the last position of k, v: [Tk, Hkv, D] -> [Hq, D], float64."""
    hq, d = q.shape
    k = k.double().repeat_interleave(hq // k.shape[1], dim=1)
    v = v.double().repeat_interleave(hq // v.shape[1], dim=1)
    weights = (torch.einsum("hd,khd->hk", q.double(), k) / math.sqrt(d)).softmax(-1)
    return torch.einsum("hk,khd->hd", weights, v)


def output_of(server: Server) -> str:
    assert server.proc.stdout is not None
    return server.proc.stdout.read().decode()


def test_sigterm_drains_in_flight_requests_then_exits_0(start_server: Any) -> None:
    server: Server = start_server({"KVPOOL_SHUTDOWN_GRACE_S": str(GRACE_S)}, ["--log-level", "info"])
    c = server.client
    torch.manual_seed(4)
    k, v = torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    c.post("/v1/sequences", json={"seq_id": "s"})
    c.post("/v1/sequences/s/append", json={"num_tokens": 7, "k": enc(k), "v": enc(v)})
    q = torch.randn(1, 4, 16)
    payload = json.dumps({"layer": 1, "seq_ids": ["s"], "q": enc(q)}).encode()

    half_sent, release = threading.Event(), threading.Event()

    def paused_body() -> Iterator[bytes]:
        yield payload[:40]
        half_sent.set()
        release.wait(30)
        yield payload[40:]

    result: dict[str, httpx.Response] = {}

    def in_flight() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as own:
            headers = {"Content-Type": "application/json"}
            result["attend"] = own.post("/v1/attend", content=paused_body(), headers=headers)

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert half_sent.wait(10)
    time.sleep(0.2)  # let the server take the request in
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    # During the grace period: not ready, but still serving (a load balancer is still sending traffic).
    with httpx.Client(base_url=server.url, timeout=10) as probe:
        r = probe.get("/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert probe.get("/v1/pool").status_code == 200
        # After it: no new connections, but the process waits for the request still in flight.
        while True:
            try:
                assert probe.get("/readyz").status_code == 503
            except httpx.TransportError:
                break
            assert time.monotonic() - signalled < 20, "the server kept listening"
            time.sleep(0.05)
    assert time.monotonic() - signalled >= GRACE_S - 0.05
    time.sleep(0.3)
    assert server.proc.poll() is None, "exited with a request in flight"

    release.set()
    thread.join(30)
    r = result["attend"]
    assert r.status_code == 200, r.text
    out = dec(r.json()["out"])
    torch.testing.assert_close(out[0].double(), dense_attention(q[0], k[1], v[1]), atol=1e-5, rtol=1e-5)

    assert server.proc.wait(30) == 0
    log = output_of(server)
    assert "Waiting for connections to close" in log
    assert log.index("Waiting for connections to close") < log.index("Application shutdown complete")
    assert "Traceback" not in log


def test_sigterm_on_an_idle_server_exits_0_after_the_lifespan_shutdown(start_server: Any) -> None:
    server: Server = start_server({"KVPOOL_LEASE_SWEEP_INTERVAL_S": "0.1"}, ["--log-level", "info"])
    c = server.client
    c.post("/v1/sequences", json={"seq_id": "held", "ttl_s": 60})
    c.post("/v1/sequences/held/append", json={"num_tokens": 5})
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    log = output_of(server)
    # The lifespan shutdown ran (the lease sweeper was cancelled cleanly: no traceback, no pending task).
    assert "Application shutdown complete" in log
    assert "Traceback" not in log and "Task was destroyed" not in log
