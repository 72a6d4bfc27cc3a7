"""The workload of `kvpool bench http`: one client = one frontend holding a few sequences.

Each client allocates prompts that share a common prefix (so prefix caching hits), prefills the
uncached part, then mixes batched decode steps, appends with K/V data, attention, forks and frees,
staying inside its share of the pool so that a correct server never runs out of pages.
"""

import base64
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from benchmarks.http_client import Transport, TransportError

MAX_SEQS = 4  # sequences one client holds at most
MAX_APPEND = 4  # tokens per append with K/V data
# action -> weight; a decode step is what a serving frontend does most.
ACTIONS = {"step": 40, "append": 15, "attend": 10, "allocate": 15, "fork": 5, "free": 15}


@dataclass
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_client: int

    @classmethod
    def from_pool(cls, pool: dict[str, Any], num_clients: int) -> "Geometry":
        free = pool["num_pages"] - pool["pages_used"]
        share = free // num_clients
        if share < 2 * MAX_SEQS + 4:
            raise SystemExit(f"{free} free pages are too few for {num_clients} clients: use more pages")
        return cls(pool["num_layers"], pool["num_kv_heads"], pool["head_dim"], pool["page_size"], share)


@dataclass
class Recorder:
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: int = 0
    error_examples: list[str] = field(default_factory=list)

    # Requests sent before this perf_counter() time are warm-up: their status counts, their latency not.
    timed_from: float = 0.0

    def record(self, route: str, status: int, started: float, ms: float, timed: bool, body: str = "") -> None:
        self.statuses[status] += 1
        if timed and started >= self.timed_from:
            self.latencies_ms.setdefault(route, []).append(ms)
        if status >= 400 and len(self.error_examples) < 20:
            self.error_examples.append(f"{route} -> {status} {body[:200]}")


def _tensor(array: np.ndarray) -> dict[str, Any]:
    data = base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")
    return {"dtype": "float32", "shape": list(array.shape), "data": data}


class Client:
    def __init__(
        self, index: int, http: Transport, geo: Geometry, rec: Recorder, rng: random.Random, tag: str = "bench"
    ) -> None:
        self.index, self.http, self.geo, self.rec, self.rng = index, http, geo, rec, rng
        self.lengths: dict[str, int] = {}  # seq_id -> tokens, as the server last reported
        self.num_created = 0
        self.num_requests = 0
        self.tag = tag  # a run's sequence ids never collide with those of an earlier run on the same server
        np_rng = np.random.default_rng(rng.randrange(2**32))
        g = geo
        # Pre-encoded random payloads: the client should spend its CPU on requests, not on base64.
        self.kv = {
            n: (_tensor(np_rng.standard_normal((g.num_layers, n, g.num_kv_heads, g.head_dim))),
                _tensor(np_rng.standard_normal((g.num_layers, n, g.num_kv_heads, g.head_dim))))
            for n in range(1, MAX_APPEND + 1)
        }  # fmt: skip
        num_q_heads = 2 * g.num_kv_heads  # a GQA group of 2
        self.q = {n: _tensor(np_rng.standard_normal((n, num_q_heads, g.head_dim))) for n in range(1, MAX_SEQS + 1)}
        shared = random.Random(12345)  # the same system prompt in every client: prefix-cache hits
        self.prefix = [shared.randrange(50_000) for _ in range(2 * g.page_size)]

    # -- plumbing -----------------------------------------------------------------------------
    async def _call(self, method: str, route: str, path: str, body: Any = None, timed: bool = True) -> Any:
        self.num_requests += 1
        start = time.perf_counter()
        try:
            status, payload = await self.http.send(method, path, body)
        except TransportError as exc:
            self.rec.transport_errors += 1
            self.rec.error_examples.append(f"{route}: {exc}")
            return None
        ms = (time.perf_counter() - start) * 1000
        self.rec.record(route, status, start, ms, timed, payload.decode(errors="replace") if status >= 400 else "")
        return orjson.loads(payload) if status < 300 else None

    def _pages_held(self, extra_tokens: dict[str, int] | None = None) -> int:
        """Pages this client's sequences may hold, counting a copy-on-write page for each."""
        extra = extra_tokens or {}
        size = self.geo.page_size
        return sum(math.ceil((n + extra.get(s, 0)) / size) + 1 for s, n in self.lengths.items())

    def _fits(self, more_pages: int = 0, extra_tokens: dict[str, int] | None = None) -> bool:
        return self._pages_held(extra_tokens) + more_pages <= self.geo.pages_per_client

    # -- actions ------------------------------------------------------------------------------
    async def allocate(self) -> None:
        prompt = self.prefix + [self.rng.randrange(50_000) for _ in range(self.rng.randint(1, 2 * self.geo.page_size))]
        if len(self.lengths) >= MAX_SEQS or not self._fits(math.ceil(len(prompt) / self.geo.page_size) + 1):
            return await self.free()
        self.num_created += 1
        seq_id = f"{self.tag}-c{self.index}-{self.num_created}"
        seq = await self._call("POST", "POST /v1/sequences", "/v1/sequences", {"seq_id": seq_id, "token_ids": prompt})
        if seq is None:
            return None
        self.lengths[seq_id] = seq["length"]
        rest = prompt[seq["length"] :]  # prefill what the prefix cache did not cover
        await self._append(seq_id, {"num_tokens": len(rest), "token_ids": rest})
        return None

    async def _append(self, seq_id: str, body: dict[str, Any]) -> None:
        path = f"/v1/sequences/{seq_id}/append"
        out = await self._call("POST", "POST /v1/sequences/{seq_id}/append", path, body)
        if out is not None:
            self.lengths[seq_id] = out["length"]

    async def append(self) -> None:
        seq_id = self.rng.choice(list(self.lengths))
        n = self.rng.randint(1, MAX_APPEND)
        if not self._fits(extra_tokens={seq_id: n}):
            return await self.free()
        k, v = self.kv[n]
        body = {"num_tokens": n, "token_ids": [self.rng.randrange(50_000) for _ in range(n)], "k": k, "v": v}
        return await self._append(seq_id, body)

    async def step(self) -> None:
        seq_ids = list(self.lengths)
        if not self._fits(extra_tokens=dict.fromkeys(seq_ids, 1)):
            return await self.free()
        appends = [{"seq_id": s, "num_tokens": 1, "token_ids": [self.rng.randrange(50_000)]} for s in seq_ids]
        out = await self._call("POST", "POST /v1/step", "/v1/step", {"appends": appends})
        if out is not None:
            for s in seq_ids:
                self.lengths[s] += 1
        return None

    async def attend(self) -> None:
        seq_ids = [s for s, n in self.lengths.items() if n > 0]
        if not seq_ids:
            return await self.allocate()
        body = {"layer": self.rng.randrange(self.geo.num_layers), "seq_ids": seq_ids, "q": self.q[len(seq_ids)]}
        await self._call("POST", "POST /v1/attend", "/v1/attend", body)
        return None

    async def fork(self) -> None:
        parent = self.rng.choice(list(self.lengths))
        if len(self.lengths) >= MAX_SEQS or not self._fits(math.ceil(self.lengths[parent] / self.geo.page_size) + 1):
            return await self.free()
        self.num_created += 1
        child = f"{self.tag}-c{self.index}-{self.num_created}"
        path = f"/v1/sequences/{parent}/fork"
        out = await self._call("POST", "POST /v1/sequences/{seq_id}/fork", path, {"seq_id": child})
        if out is not None:
            self.lengths[child] = out["length"]

    async def free(self, seq_id: str | None = None, timed: bool = True) -> None:
        if not self.lengths:
            return
        if seq_id is None:  # the longest: it holds the most pages
            seq_id = max(self.lengths, key=self.lengths.__getitem__)
        await self._call("DELETE", "DELETE /v1/sequences/{seq_id}", f"/v1/sequences/{seq_id}", timed=timed)
        # Gone either way: a failed free is counted as an error and must not be retried forever.
        del self.lengths[seq_id]

    # -- loop ---------------------------------------------------------------------------------
    async def run(self, deadline: float, max_requests: int) -> None:
        names, weights = list(ACTIONS), list(ACTIONS.values())
        while self.num_requests < max_requests and time.perf_counter() < deadline:
            action = self.rng.choices(names, weights)[0] if self.lengths else "allocate"
            await getattr(self, action)()

    async def free_all(self) -> None:
        for seq_id in list(self.lengths):
            await self.free(seq_id, timed=False)
