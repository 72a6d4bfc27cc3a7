"""`kvpool bench match`: the cost of POST /v1/prefix/match (how much of a prompt this pool holds, for a
cache-aware router), in process and over HTTP, for a prompt whose pages are all cached (the longest
walk) and for one that misses at its first page.

Targets for a 4,096-token prompt: <= 50 us in process, <= 1 ms p50 over loopback HTTP.
With --spill host|disk, also for a prompt whose pages are all in the spill tier (evicted from the
device): the route then walks the device's index, then the tier's (PrefixCache.match), as a peek.
"""

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable

import httpx
import orjson

from benchmarks.http import start_server, stop_server
from benchmarks.http_client import RawTransport
from service.core import is_compiled
from service.core.allocator import PageAllocator
from service.core.plan import checked_token_bytes
from service.core.sequences import SequenceTable
from service.core.tier_index import TierIndex

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
    out["tier"] = in_process_tier(num_tokens, page_size, repeat)
    return out


def in_process_tier(num_tokens: int, page_size: int, repeat: int) -> float:
    """p50 microseconds of the route's work when the device holds none of the prompt and the node's
    tier holds it all: the device's match, then the tier index's peek (PrefixCache.match's walk)."""
    table = SequenceTable(PageAllocator(16), page_size)
    hit, _ = prompts(num_tokens)
    max_pages = (num_tokens - 1) // page_size
    index, nbytes = TierIndex(max_pages), page_size * 8
    _, root, _ = table.prefixes.match(hit, "")
    parent, data = root, checked_token_bytes(hit[: max_pages * page_size])
    for i in range(max_pages):
        key = parent + data[i * nbytes : (i + 1) * nbytes]
        parent = hashlib.sha256(key).digest()
        slot = index.reserve(parent, key)
        assert slot is not None and index.ready(parent, slot[0])
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        pages, last, _ = table.prefixes.match(hit, "")
        rest = checked_token_bytes(hit[len(pages) * page_size : max_pages * page_size])
        found = len(index.match(last, rest, nbytes, touch=False))
        times.append(time.perf_counter() - start)
    assert found == max_pages
    return statistics.median(times) * 1e6


def over_http(num_tokens: int, page_size: int, repeat: int, spill: str = "none") -> dict[str, float]:
    """p50 milliseconds of POST /v1/prefix/match from one keep-alive connection, with bench http's raw
    client (~0.2 ms of client CPU: the figure is the server's and the loopback's) and with httpx
    (whose own cost per 23 kB request is several times the server's on this machine)."""
    num_pages = 2 * num_tokens // page_size + 16
    env = {"KVPOOL_PAGE_SIZE": str(page_size)}
    if spill != "none":  # a small geometry (8 KiB pages at page 16): the tier's copies stay cheap
        env |= {"KVPOOL_SPILL": spill, "KVPOOL_SPILL_PATH": tempfile.gettempdir(), "KVPOOL_NUM_LAYERS": "2"}
        env |= {"KVPOOL_NUM_KV_HEADS": "2", "KVPOOL_HEAD_DIM": "16", "KVPOOL_DTYPE": "float32"}
        env["KVPOOL_SPILL_BYTES"] = str(num_pages * (2 * 2 * 2 * 16 * 4 * page_size + 64))
    proc, url = start_server(num_pages, env)
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
            if spill != "none":
                out["tier"] = tier_p50(c, url, hit, num_pages, expected // page_size, repeat)
            assert c.post("/v1/prefix/match", content=body, headers=headers).json()["cached_tokens"] == expected
            out["httpx hit"] = median_ms(lambda: c.post("/v1/prefix/match", content=body, headers=headers), repeat)
        for name, prompt in (("hit", hit), ("miss", miss)):
            out[name] = asyncio.run(raw_p50(url, {"token_ids": prompt}, repeat))
    finally:
        stop_server(proc)
    return out


def tier_p50(c: httpx.Client, url: str, hit: list[int], num_pages: int, num_hit: int, repeat: int) -> float:
    """Evict the hit prompt into the tier, time the match there, then bring it back (a create)."""
    seq = c.post("/v1/sequences", json={}).json()["seq_id"]
    c.post(f"/v1/sequences/{seq}/append", json={"num_tokens": num_pages * int(c.get("/v1/pool").json()["page_size"])})
    c.delete(f"/v1/sequences/{seq}")
    deadline = time.monotonic() + 30
    while (got := c.post("/v1/prefix/match", json={"token_ids": hit}).json())["tier_pages"] < num_hit:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    assert got["device_pages"] == 0
    p50 = asyncio.run(raw_p50(url, {"token_ids": hit}, repeat))
    created = c.post("/v1/sequences", json={"token_ids": hit}).json()  # restored: a device hit again
    assert created["cached_tokens"] == got["cached_tokens"]
    c.delete(f"/v1/sequences/{created['seq_id']}")
    return p50


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
    print(f"  in process, all in the spill tier (device walk, then the tier index's peek): p50 {local['tier']:.1f} us")
    http = over_http(n, page, repeat // 4, args.spill)
    print(
        f"  over HTTP (keep-alive, bench http's raw client): p50 {http['hit']:.3f} ms all cached, "
        f"{http['miss']:.3f} ms missing at the first page (target <= {TARGET_HTTP_MS:.0f} ms); "
        f"with httpx as the client {http['httpx hit']:.3f} ms all cached"
    )
    if "tier" in http:
        print(f"  over HTTP, KVPOOL_SPILL={args.spill}, all pages in the tier: p50 {http['tier']:.3f} ms")
    met = local["hit"] <= TARGET_IN_PROCESS_US and http["hit"] <= TARGET_HTTP_MS
    print("  targets met" if met else "  targets NOT met")
    return 0
