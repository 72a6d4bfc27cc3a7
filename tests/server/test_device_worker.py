"""Device work runs on the engine's worker thread, not on the event loop: while a long prefill `attend`
runs, the probes and the bookkeeping routes keep answering within 100 ms.
"""

import threading
import time
from typing import Any

import httpx
import torch

from tests.conftest import Server, dec, enc

T, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 2048, 16, 2, 64, 16
PROBE_LIMIT_S = 0.1


def test_probes_answer_while_a_long_attend_runs(start_server: Any) -> None:
    server: Server = start_server(
        {
            "KVPOOL_NUM_LAYERS": "1",
            "KVPOOL_NUM_KV_HEADS": str(KV_HEADS),
            "KVPOOL_HEAD_DIM": str(HEAD_DIM),
            "KVPOOL_PAGE_SIZE": str(PAGE),
            "KVPOOL_NUM_PAGES": str(T // PAGE + 8),
        }
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, Q_HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    server.client.post("/v1/sequences", json={"seq_id": "long"}).raise_for_status()
    server.client.post("/v1/sequences/long/append", json={"num_tokens": T}).raise_for_status()
    body = {"layer": 0, "seq_ids": ["long"], "q": enc(q), "q_lens": [T], "k": enc(k), "v": enc(v)}
    answer: dict[str, Any] = {}

    def attend() -> None:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            answer["response"] = client.post("/v1/attend", json=body)

    worker = threading.Thread(target=attend)
    probes: list[tuple[str, float]] = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.get("/healthz")  # the connection is open before the attend starts
        worker.start()
        time.sleep(0.3)  # the attend's body is read and parsed; its device job runs from here on
        while worker.is_alive():
            for path in ("/healthz", "/readyz", "/v1/pool", "/v1/sequences/long"):
                started = time.perf_counter()
                assert client.get(path).status_code == 200
                if worker.is_alive():  # answered while the attend was still running
                    probes.append((path, time.perf_counter() - started))
            time.sleep(0.01)
    worker.join()
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert dec(response.json()["out"]).shape == (T, Q_HEADS, HEAD_DIM)
    assert len(probes) >= 8, f"the attend ended before the probes could see it: {probes}"
    slow = [(path, round(seconds * 1000, 1)) for path, seconds in probes if seconds > PROBE_LIMIT_S]
    # A shared host may deschedule the server now and then: 1 % of the probes may be late, none by much.
    assert len(slow) <= len(probes) // 100, f"answers slower than {PROBE_LIMIT_S * 1000:.0f} ms (ms): {slow}"
    assert max(seconds for _, seconds in probes) < 2.5 * PROBE_LIMIT_S, f"a probe waited (ms): {slow}"
