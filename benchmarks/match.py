"""`kvpool bench match`: the cost of POST /v1/prefix/match (how much of a prompt this pool holds, for a
cache-aware router), in process and over HTTP, for a prompt whose pages are all cached (the longest
walk) and for one that misses at its first page.

Targets for a 4,096-token prompt: <= 50 us in process, <= 1 ms p50 over loopback HTTP.
"""

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import httpx
import orjson

from benchmarks.http import start_server, stop_server
from benchmarks.http_client import RawTransport
from service.core import is_compiled
from service.core.allocator import PageAllocator
from service.core.sequences import SequenceTable

TARGET_IN_PROCESS_US = 50.0
TARGET_HTTP_MS = 1.0


def prompts(num_tokens: int) -> tuple[list[int], list[int]]:
    hit = [(i * 7919) % 32000 for i in range(num_tokens)]
    return hit, [31999 - t for t in hit]


def in_process(num_tokens: int, page_size: int, repeat: int) -> dict[str, float]:
    """p50 microseconds of Prefixes.num_cached (what the route calls) on a pool holding the hit prompt."""
    table = SequenceTable(PageAllocator(2 * num_tokens // page_size + 16), page_size)
    hit, miss = prompts(num_tokens)
    seq = table.create("warm", [])
    table.append(seq.seq_id, num_tokens, hit, True)
    table.free(seq.seq_id)
    out = {}
    for name, prompt in (("hit", hit), ("miss", miss)):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            table.prefixes.num_cached(prompt, "")
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    assert table.prefixes.num_cached(hit, "") == (num_tokens - 1) // page_size
    return out


def over_http(num_tokens: int, page_size: int, repeat: int) -> dict[str, float]:
    """p50 milliseconds of POST /v1/prefix/match from one keep-alive connection, with bench http's raw
    client (~0.2 ms of client CPU: the figure is the server's and the loopback's) and with httpx
    (whose own cost per 23 kB request is several times the server's on this machine)."""
    proc, url = start_server(2 * num_tokens // page_size + 16, {"KVPOOL_PAGE_SIZE": str(page_size)})
    hit, miss = prompts(num_tokens)
    out = {}
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            seq = c.post("/v1/sequences", json={}).json()["seq_id"]
            c.post(f"/v1/sequences/{seq}/append", json={"num_tokens": num_tokens, "token_ids": hit})
            c.delete(f"/v1/sequences/{seq}")
            headers = {"content-type": "application/json"}
            body = orjson.dumps({"token_ids": hit})
            expected = (num_tokens - 1) // page_size * page_size
            assert c.post("/v1/prefix/match", content=body, headers=headers).json()["cached_tokens"] == expected
            out["httpx hit"] = median_ms(lambda: c.post("/v1/prefix/match", content=body, headers=headers), repeat)
        for name, prompt in (("hit", hit), ("miss", miss)):
            out[name] = asyncio.run(raw_p50(url, {"token_ids": prompt}, repeat))
    finally:
        stop_server(proc)
    return out


def median_ms(call: Callable[[], object], repeat: int) -> float:
    for _ in range(20):  # warm-up
        call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def raw_p50(url: str, body: dict[str, list[int]], repeat: int) -> float:
    transport = RawTransport(url)
    try:
        times = []
        for i in range(repeat + 20):
            start = time.perf_counter()
            status, _ = await transport.send("POST", "/v1/prefix/match", body)
            if i >= 20:
                times.append(time.perf_counter() - start)
            assert status == 200
        return statistics.median(times) * 1e3
    finally:
        await transport.close()


def main(args: argparse.Namespace) -> int:
    n, page = args.tokens, args.page_size
    repeat = 200 if args.quick else 2000
    print(f"POST /v1/prefix/match, {n}-token prompt, page {page} (core compiled: {is_compiled()})")
    local = in_process(n, page, repeat)
    print(
        f"  in process: p50 {local['hit']:.1f} us all {(n - 1) // page} pages cached, {local['miss']:.1f} us "
        f"missing at the first page (target <= {TARGET_IN_PROCESS_US:.0f} us)"
    )
    http = over_http(n, page, repeat // 4)
    print(
        f"  over HTTP (keep-alive, bench http's raw client): p50 {http['hit']:.3f} ms all cached, "
        f"{http['miss']:.3f} ms missing at the first page (target <= {TARGET_HTTP_MS:.0f} ms); "
        f"with httpx as the client {http['httpx hit']:.3f} ms all cached"
    )
    met = local["hit"] <= TARGET_IN_PROCESS_US and http["hit"] <= TARGET_HTTP_MS
    print("  targets met" if met else "  targets NOT met")
    return 0
