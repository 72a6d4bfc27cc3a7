"""A 4,096-token prefill attend (16 query heads) against a real server: it runs on the engine's device
worker, so /healthz, /readyz, /metrics and GET /v1/pool answer while it runs, and the torch reference
computes it in memory linear in its length (the whole score matrix would be 1 GiB, its softmax 3 GiB).

Geometry: 16 KV heads (no GQA; GQA is the kernel tests' business) and q in bfloat16. The memory bound
counts the attend's inputs (q, k, v), and the JSON codec alone keeps several copies of q alive (the body,
its parsed string, the tensor, the output, its base64 and JSON): with 1 KV head no attention code could
stay under four times the inputs. The codec also runs on the event loop, so a smaller q is a smaller
stall that is not the device work's.
"""

import base64
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.wire.tensors import encode
from tests.conftest import Server, dec
from tests.kernels.paged_data import assert_close, dense_attention

TOKENS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 4096, 16, 16, 16, 16
NUM_PAGES = TOKENS // PAGE_SIZE + 8
POOL_BYTES = (NUM_PAGES + 1) * 2 * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # 1 layer, float32
POLLED = ["/healthz", "/readyz", "/metrics", "/v1/pool"]
WARM_UP_TOKENS = 64


def enc(a: np.ndarray) -> dict[str, Any]:
    return {"dtype": "float32", "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def proc_status(pid: int, key: str) -> int:
    """A /proc/<pid>/status field in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@dataclass
class Run:
    q: torch.Tensor  # bfloat16 [T, Hq, D], as a model sends it
    k: np.ndarray  # [1, T, H, D]: the one layer's K as appended
    v: np.ndarray
    out: torch.Tensor | None = None
    sent: float = 0.0
    answered: float = 0.0
    polls: list[tuple[str, float, float, int]] = field(default_factory=list)  # (path, start, end, status)
    peak_growth: int | None = None  # bytes; None where /proc cannot measure it


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    server = Server(
        {
            "KVPOOL_NUM_LAYERS": "1",
            "KVPOOL_NUM_KV_HEADS": str(NUM_KV_HEADS),
            "KVPOOL_HEAD_DIM": str(HEAD_DIM),
            "KVPOOL_PAGE_SIZE": str(PAGE_SIZE),
            "KVPOOL_NUM_PAGES": str(NUM_PAGES),
            "KVPOOL_DTYPE": "float32",
            "KVPOOL_DEVICE": "cpu",
            "KVPOOL_MAX_ATTEND_TOKENS": str(TOKENS * TOKENS),  # 4x the CPU default (2^22)
        }
    )
    try:
        yield attend_while_polling(server)
    finally:
        server.stop()


def attend_while_polling(server: Server) -> Run:
    rng = np.random.default_rng(11)
    kv_shape = (1, TOKENS, NUM_KV_HEADS, HEAD_DIM)
    k, v = rng.standard_normal(kv_shape, dtype=np.float32), rng.standard_normal(kv_shape, dtype=np.float32)
    q = torch.from_numpy(rng.standard_normal((TOKENS, NUM_Q_HEADS, HEAD_DIM), dtype=np.float32)).to(torch.bfloat16)
    result = Run(q=q, k=k, v=v)
    client = server.client
    for seq_id, n in (("warm-up", WARM_UP_TOKENS), ("long", TOKENS)):
        assert client.post("/v1/sequences", json={"seq_id": seq_id}).status_code == 201
        r = client.post(
            f"/v1/sequences/{seq_id}/append", json={"num_tokens": n, "k": enc(k[:, :n]), "v": enc(v[:, :n])}
        )
        assert r.status_code == 200, r.text
    # A short prefill first: one-time costs (BLAS buffers, first-use allocations) are not the long attend's.
    warm_up = {"layer": 0, "seq_ids": ["warm-up"], "q": encode(q[:WARM_UP_TOKENS]), "q_lens": [WARM_UP_TOKENS]}
    assert client.post("/v1/attend", json=warm_up).status_code == 200

    pid = server.proc.pid
    measurable = Path(f"/proc/{pid}/clear_refs").exists()
    if measurable:
        rss_before = proc_status(pid, "VmRSS")
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    # The body is serialized before and the answer parsed after: JSON work in this process would hold
    # its GIL and delay the polls' own clocks, which must time the server alone.
    body = json.dumps({"layer": 0, "seq_ids": ["long"], "q": encode(q), "q_lens": [TOKENS]}).encode()
    answers: list[httpx.Response] = []

    def attend() -> None:
        result.sent = time.monotonic()
        answers.append(client.post("/v1/attend", content=body, headers={"content-type": "application/json"}))
        result.answered = time.monotonic()

    thread = threading.Thread(target=attend)
    with httpx.Client(base_url=server.url, timeout=60) as poller:
        thread.start()
        while thread.is_alive():
            for path in POLLED:
                start = time.monotonic()
                status = poller.get(path).status_code
                result.polls.append((path, start, time.monotonic(), status))
            time.sleep(0.005)
    thread.join()
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "no answer"
    result.out = dec(answers[0].json()["out"])
    if measurable:
        result.peak_growth = proc_status(pid, "VmHWM") - rss_before
    return result


def test_the_server_answers_while_a_long_prefill_attend_runs(run: Run) -> None:
    assert run.out is not None, "the attend failed"
    during = [p for p in run.polls if p[1] > run.sent and p[2] < run.answered]
    # Polls that started after the attend was sent and ended before it answered: without them, the
    # latencies below would say nothing about the attend.
    assert len(during) >= 3 * len(POLLED), f"{len(during)} polls during a {run.answered - run.sent:.2f} s attend"
    for path, start, end, status in run.polls:
        assert status == 200, f"{path} answered {status}"
        when = f"{start - run.sent:+.2f} s from sending a {run.answered - run.sent:.2f} s attend"
        assert end - start < 0.1, f"{path} took {1000 * (end - start):.0f} ms, {when}"


def test_the_long_prefill_is_right(run: Run) -> None:
    assert run.out is not None and run.out.shape == (TOKENS, NUM_Q_HEADS, HEAD_DIM)
    rows = torch.tensor([0, 1, 15, 16, 17, 1000, 2047, 4094, 4095])
    keys, values = torch.from_numpy(run.k[0]).double(), torch.from_numpy(run.v[0]).double()
    want, _ = dense_attention(run.q[rows].double(), rows, keys, values)
    assert run.out.dtype == torch.bfloat16
    assert_close(run.out[rows], want, torch.bfloat16, "prefill rows")


def test_the_long_prefill_takes_memory_linear_in_its_length(run: Run) -> None:
    if run.peak_growth is None:
        pytest.skip("no /proc/<pid>/clear_refs here: the peak RSS cannot be reset and read")
    inputs = run.q.numel() * run.q.element_size() + run.k.nbytes + run.v.nbytes
    budget = 4 * inputs + POOL_BYTES
    assert run.peak_growth < budget, f"peak RSS grew {run.peak_growth / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB"
