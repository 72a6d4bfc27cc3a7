"""The spill tier over HTTP: a workload four times the device pool gets its evicted prefixes back
from host memory or a disk file, and attention over restored pages equals the original's bit for bit."""

import resource
import time
from typing import Any

import pytest

from tests.tiers.helpers import run_prompt, same_bits

NUM_PROMPTS = 16  # 4 pages each: 64 pages, the device pool holds 16


def metric(c: Any, name: str, tier: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'{name}{{tier="{tier}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{tier={tier}}} not exported")


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cycling_workload_hits_the_tier_and_attends_to_the_bit(start_server: Any, tmp_path: Any, tier: str) -> None:
    env = {"KVPOOL_SPILL": tier, "KVPOOL_SPILL_BYTES": str(64 * 2200), "KVPOOL_SPILL_PATH": str(tmp_path)}
    c = start_server(env).client
    first = [run_prompt(c, f"s{i}", i) for i in range(NUM_PROMPTS)]
    assert [cached for cached, _ in first] == [0] * NUM_PROMPTS
    second = [run_prompt(c, f"s{i}", i) for i in range(NUM_PROMPTS)]
    # Every prompt comes back whole: from the tier (the device kept at most 16 of the 64 pages).
    assert [cached for cached, _ in second] == [16] * NUM_PROMPTS
    for (_, a), (_, b) in zip(first, second):
        assert same_bits(a, b)
    pool = c.get("/v1/pool").json()
    assert pool["pages_used"] == 0 and pool["pages_cached"] + pool["pages_free"] == 16


def test_disk_full_spills_stop_counted_and_nothing_else_fails(start_server: Any, tmp_path: Any) -> None:
    env = {"KVPOOL_SPILL": "disk", "KVPOOL_SPILL_BYTES": str(64 * 2200), "KVPOOL_SPILL_PATH": str(tmp_path)}
    server = start_server(env)
    c = server.client
    first = [run_prompt(c, f"s{i}", i) for i in range(8)]  # prompts 0-3 spilled to the disk
    deadline = time.monotonic() + 10
    while c.get("/v1/pool").json()["tiers"][0]["bytes_out"] < 16 * 2048:  # (written by the IO thread)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The disk is full: no write may reach past byte 1 of the file (EFBIG, as ENOSPC would be).
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (1, resource.RLIM_INFINITY))
    first += [run_prompt(c, f"s{i}", i) for i in range(8, NUM_PROMPTS)]  # 4-7 evicted: their spills fail
    assert metric(c, "kvpool_tier_errors_total", "disk") >= 1
    assert metric(c, "kvpool_tier_up", "disk") == 0
    second = [run_prompt(c, f"s{i}", i) for i in range(8)]
    # What the disk held still comes back (reads work); what it could not take is recomputed.
    assert [cached for cached, _ in second] == [16] * 4 + [0] * 4
    for (_, a), (_, b) in zip(first, second):
        assert same_bits(a, b)  # right data either way
    pool = c.get("/v1/pool").json()
    assert pool["pages_used"] == 0 and pool["pages_cached"] + pool["pages_free"] == 16
    # Room again: spills resume by themselves, and the tier says so.
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    time.sleep(1.1)  # the back-off after the last failure
    for _ in range(2):
        for i in range(NUM_PROMPTS):
            run_prompt(c, f"s{i}", i)
    assert metric(c, "kvpool_tier_up", "disk") == 1
    assert [run_prompt(c, f"t{i}", i)[0] for i in range(NUM_PROMPTS)] == [16] * NUM_PROMPTS
    server.stop()
    assert server.output.count("disk tier failing") == 1, server.output
