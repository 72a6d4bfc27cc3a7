"""48 threads racing on one sequence of a live `kvpool serve`: appends (with and without K/V),
steps, forks, frees, attends and reads of the shared root, and of each other's forks, released
together by a barrier; then all of them freeing the root at once.

Checked after: every sequence's length is what its successful appends added (the root's, and each
fork's from its length at the fork); the pool's counts add up, and were polled adding up during the
race; the used pages are exactly the distinct pages of the live block tables; exactly one of the
racing frees of the root succeeds; once everything is freed no page is used and no sequence is left.
The test prints its figures.
"""

import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest

from tests.chaos.fuzz_inputs import tensor
from tests.chaos.tally import TALLY
from tests.conftest import SMALL_POOL, Server

THREADS, OPS = 48, 32
NUM_PAGES = 4096
ENV = {**SMALL_POOL, "KVPOOL_NUM_PAGES": str(NUM_PAGES)}
ROOT, ROOT_TOKENS = "root", 256
# One TLS context for every client: httpx builds one per client otherwise (~10 ms each), unused on http://.
TLS = ssl.create_default_context()


@dataclass
class Log:
    """What one thread saw: its successful appends and forks, the frees it won, every status."""

    appended: Counter[str] = field(default_factory=Counter)
    forked: dict[str, int] = field(default_factory=dict)  # child -> its length at the fork
    freed: list[str] = field(default_factory=list)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    hangs: int = 0


def counts_add_up(pool: dict[str, Any]) -> bool:
    return bool(pool["pages_used"] + pool["pages_cached"] + pool["pages_free"] == pool["num_pages"])


def worker(url: str, index: int, start: threading.Barrier, log: Log) -> None:
    rng = np.random.default_rng(index)
    mine: list[str] = []
    with httpx.Client(base_url=url, timeout=30, verify=TLS) as c:

        def call(op: str, expected: set[int], method: str, path: str, **kwargs: Any) -> httpx.Response | None:
            try:
                r = c.request(method, path, **kwargs)
            except httpx.TimeoutException:
                log.hangs += 1
                return None
            log.statuses[op, r.status_code] += 1
            if r.status_code not in expected:
                log.unexpected.append(f"{op} {method} {path}: {r.status_code} {r.text[:200]}")
            return r

        def append(seq_id: str, expected: set[int]) -> None:
            n = int(rng.integers(1, 4))
            body: dict[str, Any] = {"num_tokens": n}
            if rng.random() < 0.5:
                body |= {"k": tensor([2, n, 2, 16], 0.1 * index), "v": tensor([2, n, 2, 16], -0.1)}
            r = call("append", expected, "POST", f"/v1/sequences/{seq_id}/append", json=body)
            if r is not None and r.status_code == 200:
                log.appended[seq_id] += n
                assert len(r.json()["slots"]) == n

        start.wait()
        for j in range(OPS):
            op = rng.choice(["append", "step", "fork", "child", "other", "free", "attend", "get"])
            if op == "append":
                append(ROOT, {200})
            elif op == "step":
                appends = [{"seq_id": ROOT, "num_tokens": 1}] + [{"seq_id": s, "num_tokens": 1} for s in mine[-1:]]
                listed = [ROOT, *mine]
                # Another thread may have freed a fork of this one: then the whole step is refused.
                r = call("step", {200, 404}, "POST", "/v1/step", json={"appends": appends, "seq_ids": listed})
                if r is not None and r.status_code == 200:
                    for a in appends:
                        log.appended[a["seq_id"]] += 1
                    assert r.json()["input_lengths"] == [1] + [int(s == mine[-1]) for s in mine]
            elif op == "fork":
                child = f"t{index}-{j}"
                r = call("fork", {201}, "POST", f"/v1/sequences/{ROOT}/fork", json={"seq_id": child})
                if r is not None and r.status_code == 201:
                    log.forked[child] = r.json()["length"]
                    mine.append(child)
            elif op == "child" and mine:  # (another thread may have freed it)
                append(mine[int(rng.integers(len(mine)))], {200, 404})
            elif op == "other":  # another thread's fork: it may not exist (yet, or any more)
                other = f"t{int(rng.integers(THREADS))}-{int(rng.integers(OPS))}"
                if rng.random() < 0.5:
                    append(other, {200, 404})
                else:
                    r = call("free other", {200, 404}, "DELETE", f"/v1/sequences/{other}")
                    if r is not None and r.status_code == 200:
                        log.freed.append(other)
            elif op == "free" and mine:
                child = mine.pop(int(rng.integers(len(mine))))
                r = call("free", {200, 404}, "DELETE", f"/v1/sequences/{child}")
                if r is not None and r.status_code == 200:
                    log.freed.append(child)
            elif op == "attend":  # up to 160 queries: the larger ones run on the device worker, with awaits
                q_len = int(rng.integers(1, 161))
                body = {"layer": int(rng.integers(2)), "seq_ids": [ROOT], "q": tensor([q_len, 4, 16])}
                body["q_lens"] = [q_len]
                if rng.random() < 0.3:  # K/V for the last q_len positions, written before attending
                    body |= {"k": tensor([q_len, 2, 16], 0.5), "v": tensor([q_len, 2, 16], 0.5)}
                r = call("attend", {200}, "POST", "/v1/attend", json=body)
                if r is not None and r.status_code == 200:
                    assert r.json()["out"]["shape"] == [q_len, 4, 16]
            else:
                call("get", {200}, "GET", f"/v1/sequences/{ROOT}")


def free_root_at_once(url: str, start: threading.Barrier, log: Log) -> None:
    with httpx.Client(base_url=url, timeout=30, verify=TLS) as c:
        start.wait()
        r = c.delete(f"/v1/sequences/{ROOT}")
        log.statuses["free root", r.status_code] += 1


def monitor(c: httpx.Client, done: threading.Event, polls: list[bool]) -> None:
    while not done.is_set():
        polls.append(counts_add_up(c.get("/v1/pool").json()))
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_threads_racing_on_one_sequence_keep_every_invariant(start_server: Any) -> None:
    server: Server = start_server(ENV)
    c = server.client
    assert c.post("/v1/sequences", json={"seq_id": ROOT}).status_code == 201
    kv = {"k": tensor([2, ROOT_TOKENS, 2, 16], 0.3), "v": tensor([2, ROOT_TOKENS, 2, 16], 0.4)}
    assert c.post(f"/v1/sequences/{ROOT}/append", json={"num_tokens": ROOT_TOKENS, **kv}).status_code == 200

    logs = [Log() for _ in range(THREADS)]
    start, done, polls = threading.Barrier(THREADS), threading.Event(), []
    threads = [threading.Thread(target=worker, args=(server.url, i, start, logs[i])) for i in range(THREADS)]
    watcher = threading.Thread(target=monitor, args=(server.client, done, polls))
    started = time.monotonic()
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    done.set()
    watcher.join()
    race_s = time.monotonic() - started
    stuck = sum(t.is_alive() for t in threads)

    appended: Counter[str] = sum((log.appended for log in logs), Counter())
    forked = {child: length for log in logs for child, length in log.forked.items()}
    freed = {seq_id for log in logs for seq_id in log.freed}
    statuses = sum((log.statuses for log in logs), Counter())
    unexpected = [line for log in logs for line in log.unexpected]
    hangs = stuck + sum(log.hangs for log in logs)

    # Lengths: the root's and every live fork's are what the successful appends added.
    wrong_lengths = []
    live = {ROOT: ROOT_TOKENS + appended[ROOT]} | {
        child: forked[child] + appended[child] for child in forked.keys() - freed
    }
    tables = {}
    for seq_id, want in live.items():
        body = c.get(f"/v1/sequences/{seq_id}").json()
        tables[seq_id] = body["block_table"]
        if body["length"] != want:
            wrong_lengths.append(f"{seq_id}: {body['length']} != {want}")
    gone = [s for s in freed if c.get(f"/v1/sequences/{s}").status_code != 404]
    pool = c.get("/v1/pool").json()
    distinct_pages = len({page for table in tables.values() for page in table})

    # Then every thread frees the root at once; the forks are freed after.
    logs_free = [Log() for _ in range(THREADS)]
    start = threading.Barrier(THREADS)
    racers = [threading.Thread(target=free_root_at_once, args=(server.url, start, log)) for log in logs_free]
    for t in racers:
        t.start()
    for t in racers:
        t.join(30)
    root_frees = sum((log.statuses for log in logs_free), Counter())
    for child in forked.keys() - freed:
        assert c.delete(f"/v1/sequences/{child}").status_code == 200
    end = c.get("/v1/pool").json()
    leaked = end["pages_used"]

    server_errors = sum(n for (_, status), n in statuses.items() if status >= 500)
    crashed = server.proc.poll() is not None
    print(
        f"chaos races: {THREADS} threads, {sum(statuses.values())} requests in {race_s:.1f} s "
        f"({', '.join(f'{op} {s}: {n}' for (op, s), n in sorted(statuses.items()))}), "
        f"{len(forked)} forks, {len(freed)} freed, root {live[ROOT]} tokens; {server_errors} 5xx, "
        f"{int(crashed)} crashes, {leaked} leaked pages, {hangs} hangs, {len(unexpected)} unexpected answers, "
        f"{len(wrong_lengths)} wrong lengths, {polls.count(False)} of {len(polls)} pool polls not adding up"
    )
    failures = server_errors + int(crashed) + hangs + len(unexpected) + len(wrong_lengths) + len(gone)
    failures += leaked + polls.count(False) + (root_frees[("free root", 200)] != 1)
    TALLY.record(
        "races",
        requests=sum(statuses.values()) + sum(root_frees.values()),
        failures=failures,
        held=f"{THREADS} threads on one sequence: lengths, pool counts ({len(polls)} polls), used pages = the "
        f"live tables' pages, one free of the root won, {leaked} pages left",
    )
    assert (server_errors, int(crashed), hangs) == (0, 0, 0)
    assert unexpected == [], unexpected[:10]
    assert wrong_lengths == [] and gone == []
    assert all(polls) and len(polls) > 0 and counts_add_up(pool)
    assert pool["pages_used"] == distinct_pages and pool["num_sequences"] == len(live)
    assert root_frees == Counter({("free root", 200): 1, ("free root", 404): THREADS - 1})
    assert (leaked, end["num_sequences"]) == (0, 0) and counts_add_up(end)
