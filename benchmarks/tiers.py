"""`kvpool bench tiers`: getting a 4,096-token prefix back from each tier, against a plain copy of the
same bytes (the tier's ceiling) and against recomputing it; and the hit rate of a workload whose
working set is 4x the device pool, with the tiers and without.

In process: a PoolState on the CPU (the server's own state: allocator, engine, tiers) driven as the
routes drive it, and a redis-server subprocess on a free loopback port for the remote tier. The
default geometry is the KV of the model `python -m benchmarks.vllm_connector` runs (8 layers, 4 KV
heads of 64, float32; page 16): its prefill is the recompute time quoted (docs/benchmarks.md).
"""

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from benchmarks import report
from benchmarks.processes import stop
from service.cli import free_port
from service.config import Settings
from service.pool import PoolState
from service.tiers.disk import DiskTier
from service.tiers.remote_tier import WRITE_BATCH_BYTES, RemoteTier

# Prefill of the vLLM benchmark's model on this machine (docs/benchmarks-history.md, "vLLM with kvpool's KV connector":
# cold TTFT of 2,048 tokens 342-363 ms on an idle machine); linear in the prompt length at this size.
PREFILL_MS_PER_TOKEN = 342 / 2048


def settings(a: argparse.Namespace, pages: int, **tiers: Any) -> Settings:
    geometry = dict(num_layers=a.layers, num_kv_heads=a.kv_heads, head_dim=a.head_dim, page_size=a.page_size)
    return Settings(**geometry, num_pages=pages, device="cpu", dtype="float32", **tiers)


class Driver:
    """Drives a PoolState as the routes do: write a prefix, evict everything cached, look a prompt up."""

    def __init__(self, state: PoolState, a: argparse.Namespace) -> None:
        self.state, self.a, self.count = state, a, 0
        self.shape = (a.layers, a.prefix, a.kv_heads, a.head_dim)

    def prompt(self, i: int) -> list[int]:
        return [i * 100_000 + t for t in range(self.a.prefix)] + [7]

    async def write(self, i: int) -> int:
        """A request for prompt i: look it up (restoring from the tiers), write what is missing (as a
        prefill would), free it. Returns cached_tokens."""
        seqs, engine = self.state.sequences, self.state.engine
        tokens = self.prompt(i)
        seq_id, cached = await self.lookup(i)
        todo = self.a.prefix - cached
        if todo:
            g = torch.Generator().manual_seed(i)
            k, v = torch.randn(*self.shape, generator=g), torch.randn(*self.shape, generator=g)
            _, ext = seqs.append(seq_id, todo, tokens[cached : self.a.prefix], data_written=True)
            slots = torch.from_numpy(ext.slots)
            await engine.submit(lambda: engine.write(k[:, cached:], v[:, cached:], slots))
        seqs.free(seq_id)
        return cached

    async def lookup(self, i: int) -> tuple[str, int]:
        """POST /v1/sequences with prompt i's token ids: restore, create; returns (seq_id, cached_tokens)."""
        self.count += 1
        seq = await self.state.create_sequence(f"w{self.count}", self.prompt(i), "", 0, "")
        return seq.seq_id, seq.cached_tokens

    async def written(self, store: "RedisProcess", num_keys: int) -> None:
        """Wait until the store holds num_keys pages (the remote writer runs behind the commits)."""
        while store.dbsize() < num_keys:
            await asyncio.sleep(0.01)

    async def evict_all(self) -> None:
        """Every cached page out of the device (into the spill tier, if any): a sequence takes the pool."""
        seqs = self.state.sequences
        seqs.create("fill")
        seqs.append("fill", self.state.allocator.num_available * self.a.page_size)  # no ids: never cached
        seqs.free("fill")
        await self.settle()

    async def settle(self) -> None:
        await self.state.engine.submit(lambda: None)
        for tier in self.state.cache.tiers:
            if isinstance(tier, DiskTier):
                await asyncio.wrap_future(tier.io.submit(lambda: None))
        await asyncio.sleep(0.05)


def mean_ms(samples: list[float]) -> float:
    return 1000 * statistics.fmean(samples)


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Wall times of `repeat` calls, after one untimed call (first-touch page faults, connections)."""
    fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


async def restore_times(
    state: PoolState,
    a: argparse.Namespace,
    store: "RedisProcess",
    ceiling: Callable[[], Any],
    reference: Callable[[], float | None] = lambda: None,
) -> list[tuple[float, float, float | None]]:
    """Write a.repeat + 1 prefixes, push each out of the device, then time bringing it back, right after
    timing the tier's ceiling on the same bytes (side by side: this machine is shared). The first
    restore is not counted (as the ceilings' first call is not: first-touch page faults, in this
    process and in the store, and connections). `reference` (redis-benchmark, for the remote tier) is
    measured right after each restore. Returns [(restore seconds, ceiling seconds, reference GB/s)]."""
    d = Driver(state, a)
    pairs = []
    ceiling()  # (first touch)
    state.storage.blocks.zero_()  # fault the pool's pages in, as a server that has run a while has
    for i in range(a.repeat + 1):
        await d.write(i)
        if state.cache.tier("remote") is not None:
            await d.written(store, (i + 1) * (a.prefix // a.page_size))
        await d.evict_all()
        start = time.perf_counter()
        ceiling()
        ceiling_s = time.perf_counter() - start
        start = time.perf_counter()
        seq_id, cached = await d.lookup(i)
        restore_s = time.perf_counter() - start
        pairs.append((restore_s, ceiling_s, reference()))
        state.sequences.free(seq_id)
        assert cached == a.prefix, f"prefix {i}: {cached} of {a.prefix} tokens came back"
    return pairs[1:]


class Ceilings:
    """A plain move of the same bytes per tier: a host-to-host copy; a read of a file just written (in
    the page cache, as the spill file is); redis-py MGETs of 32 values of a page's size (the client's
    own ceiling, raw bytes, in database 1 of the same server)."""

    def __init__(self, nbytes: int, directory: str, url: str, value_nbytes: int, num: int) -> None:
        self.src, self.dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        self.path = os.path.join(directory, "ceiling.bin")
        with open(self.path, "wb") as f:
            f.write(self.src.numpy().tobytes())
        self.buf = np.empty(nbytes, dtype=np.uint8)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.client = redis.Redis.from_url(url.rsplit("/", 1)[0] + "/1")
        self.keys = [f"ceiling:{i}" for i in range(num)]
        value = os.urandom(value_nbytes)
        self.client.mset({k: value for k in self.keys})

    def host(self) -> None:
        self.dst.copy_(self.src)

    def disk(self) -> None:
        os.preadv(self.fd, [memoryview(self.buf.data)], 0)

    def remote(self) -> None:
        for s in range(0, len(self.keys), 32):
            self.client.mget(self.keys[s : s + 32])

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.client.flushdb()


def redis_benchmark(port: int, value_nbytes: int, num: int) -> float | None:
    """GB/s of the redis-benchmark binary's GETs of values of our size (1 client, pipeline 32), in db 1."""
    binary = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    if binary is None:
        return None
    cmd = [binary, "-p", str(port), "-t", "set,get", "-d", str(value_nbytes), "-n", str(num), "-c", "1", "-P", "32"]
    cmd += ["--dbnum", "1"]  # (not among the tier's keys, whose count the benchmark waits for)
    run = subprocess.run([*cmd, "--csv"], capture_output=True, text=True, timeout=300)
    for line in run.stdout.splitlines():
        if line.startswith('"GET"'):
            return float(line.split(",")[1].strip('"')) * value_nbytes / 1e9
    return None


async def mac_cost(
    a: argparse.Namespace, device_pages: int, store: "RedisProcess", plain: dict[str, Any], sealed: dict[str, Any]
) -> tuple[float, float]:
    """What sealing entries with a keyed MAC costs a restore: two pools on the same store, one with the
    checksum and one with the MAC, restore the same prefix one right after the other (which goes first
    alternating), a.repeat times after one untimed pair. Returns the median ratios - 1 of the wall times
    and of this process's CPU time (the reader's thread and the loop's; steadier on a busy machine)."""
    states = [PoolState(settings(a, device_pages, **plain)), PoolState(settings(a, device_pages, **sealed))]
    try:
        drivers = [Driver(state, a) for state in states]
        for state in states:
            state.storage.blocks.zero_()  # (first touch)
        wall, cpu = [], []
        for i in range(a.repeat + 1):
            for n, d in enumerate(drivers):
                await d.write(i)
                await d.written(store, (2 * i + n + 1) * (a.prefix // a.page_size))  # (each its own keys)
            for d in drivers:
                await d.evict_all()
            times: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]
            for n in (0, 1) if i % 2 else (1, 0):
                start, start_cpu = time.perf_counter(), time.process_time()
                seq_id, cached = await drivers[n].lookup(i)
                times[n] = (time.perf_counter() - start, time.process_time() - start_cpu)
                states[n].sequences.free(seq_id)
                assert cached == a.prefix, f"prefix {i}: {cached} of {a.prefix} tokens came back"
            if i:
                wall.append(times[1][0] / times[0][0])
                cpu.append(times[1][1] / max(times[0][1], 1e-9))
        return statistics.median(wall) - 1, statistics.median(cpu) - 1
    finally:
        for state in states:
            state.close()
        store.flush()


def write_cost(a: argparse.Namespace, url: str, page_nbytes: int) -> dict[str, float]:
    """What writing a prefix's pages to the store costs the write thread: RemoteStore.put over kvpool's own
    connection (each value sent from its gathered row) against the same put through redis-py's pipeline
    (the path clusters take; the only one until session 18), in the tier's batches (WRITE_BATCH_BYTES),
    on the same store, alternating which goes
    first, a.repeat * 4 puts each after one untimed pair, each under its own keys. Returns the medians of
    each's wall and CPU time (this thread: the put runs on the caller's) per page, in ms."""
    from service.tiers.entries import EntryFormat
    from service.tiers.remote import RemoteStore

    num, batch = a.prefix // a.page_size, max(1, WRITE_BATCH_BYTES // page_nbytes)
    data = np.random.default_rng(0).integers(0, 256, (num, page_nbytes), dtype=np.uint8)
    tokens = [os.urandom(8 * a.page_size) for _ in range(num)]
    stores = {"own": RemoteStore(url, 10.0, 600, EntryFormat("bench-writes"), page_nbytes)}
    stores["redis-py"] = RemoteStore(url, 10.0, 600, EntryFormat("bench-writes"), page_nbytes)
    stores["redis-py"].writer = None
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
    try:
        for i in range(a.repeat * 4 + 1):
            for name in list(stores)[:: 1 if i % 2 else -1]:
                hashes = [os.urandom(32) for _ in range(num)]
                start, start_cpu = time.perf_counter(), time.thread_time()
                for first in range(0, num, batch):  # (in the tier's batches)
                    end = first + batch
                    stores[name].put(hashes[first:end], tokens[first:end], data[first:end])
                if i:
                    times[name].append((time.perf_counter() - start, time.thread_time() - start_cpu))
    finally:
        for store in stores.values():
            store.close()
    out = {}
    for name, pairs in times.items():
        out[f"{name}_wall_ms_per_page"] = statistics.median(w for w, _ in pairs) * 1e3 / num
        out[f"{name}_cpu_ms_per_page"] = statistics.median(c for _, c in pairs) * 1e3 / num
    return out


async def hit_rate(a: argparse.Namespace, device_pages: int, tiers: dict[str, Any]) -> float:
    """Prompt tokens found / looked up, over a.requests uniform draws among a.prefixes prefixes (after
    one pass that writes them all)."""
    state = PoolState(settings(a, device_pages, **tiers))
    try:
        d = Driver(state, a)
        for i in range(a.prefixes):
            await d.write(i)
            await d.settle()
        rng = random.Random(0)
        found = 0
        for _ in range(a.requests):
            found += await d.write(rng.randrange(a.prefixes))
            await d.settle()
        return found / (a.requests * a.prefix)
    finally:
        state.close()


class RedisProcess:
    """One redis-server on a free loopback port; with cluster_of=N, N of them joined as a Redis Cluster
    (ports P whose bus port P + 10000 is free too; the cluster's URL lists them all)."""

    def __init__(self, cluster_of: int = 0) -> None:
        binary = shutil.which("valkey-server") or shutil.which("redis-server")
        cli = shutil.which("valkey-cli") or shutil.which("redis-cli")
        if binary is None or (cluster_of and cli is None):
            raise SystemExit("kvpool bench tiers needs redis-server (and redis-cli for a cluster)")
        self.ports = [self.free_pair() for _ in range(cluster_of)] if cluster_of else [free_port()]
        self.port = self.ports[0]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        if cluster_of:
            self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.dir = tempfile.mkdtemp(prefix="kvpool-bench-redis-")
        # One client per node, made once: dbsize() polls them while the remote writer catches up.
        self._clients = [redis.Redis(host="127.0.0.1", port=p) for p in self.ports]
        self.procs = []
        for port in self.ports:
            args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir]
            if cluster_of:
                args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            self.procs.append(subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL))
        try:
            self.wait(lambda client: client.ping())
            if cluster_of:
                assert cli is not None
                nodes = [f"127.0.0.1:{p}" for p in self.ports]
                create = [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
                subprocess.run(create, check=True, capture_output=True, timeout=60)
                self.wait(lambda client: "ok" in str(client.execute_command("CLUSTER INFO")))
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def free_pair() -> int:
        while True:
            port = free_port()
            if port + 10000 < 65536:
                with socket.socket() as bus:
                    try:
                        bus.bind(("127.0.0.1", port + 10000))
                        return port
                    except OSError:
                        pass

    def clients(self) -> list["redis.Redis"]:
        return self._clients

    def wait(self, ready: Callable[["redis.Redis"], Any]) -> None:
        for _ in range(400):
            try:
                if all(ready(client) for client in self.clients()):
                    return
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        raise SystemExit("redis-server did not start")

    def dbsize(self) -> int:
        return sum(int(client.dbsize()) for client in self.clients())  # type: ignore[arg-type,misc]

    def flush(self) -> None:
        for client in self.clients():
            client.flushdb()

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc, signal.SIGKILL)
        for client in self._clients:
            client.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    pages_per_prefix = a.prefix // a.page_size
    device_pages = a.device_prefixes * pages_per_prefix + 1  # (+1: the prompt's last token)
    work_pages = a.prefixes * pages_per_prefix
    probe = settings(a, device_pages)
    nbytes = pages_per_prefix * probe.page_nbytes
    tier_bytes = (work_pages + pages_per_prefix) * (probe.page_nbytes + 64)
    print(f"geometry: {a.layers} layers, {a.kv_heads} KV heads of {a.head_dim}, float32, page {a.page_size}")
    print(f"prefix: {a.prefix} tokens = {pages_per_prefix} pages = {nbytes / 2**20:.1f} MiB; device pool")
    ratio = work_pages / device_pages
    print(f"  {device_pages} pages ({a.device_prefixes} prefixes); working set {a.prefixes} prefixes (x{ratio:.1f})")
    result = report.new_result("tiers", getattr(a, "argv", ["kvpool", "bench", "tiers"]))
    result |= {
        "prefix_tokens": a.prefix,
        "prefix_bytes": nbytes,
        "working_set_ratio": ratio,
        "tiers": [],
        "hit_rate": {},
    }
    store = RedisProcess()
    cluster: RedisProcess | None = None
    directory = tempfile.mkdtemp(prefix="kvpool-bench-tiers-")
    try:
        store_conf = dict(remote_url=store.url, remote_timeout_s=10.0)  # (a busy machine: no store timeouts)
        configs = {
            "host": dict(spill="host", spill_bytes=tier_bytes),
            "disk": dict(spill="disk", spill_bytes=tier_bytes, spill_path=directory),
            "remote": store_conf,
            "remote-redispy": store_conf,
            "remote-mac": store_conf | dict(remote_secret="bench-secret-0123456789abcdef"),
            "remote-cluster": {},  # (a 3-node cluster, started below if asked for)
        }
        names = [n for n in a.tiers.split(",") if n]
        if unknown := set(names) - set(configs):
            raise SystemExit(f"unknown tiers: {', '.join(sorted(unknown))}")
        if "remote-cluster" in names:
            cluster = RedisProcess(cluster_of=3)
            configs["remote-cluster"] = store_conf | dict(remote_url=cluster.url)
        value_nbytes = probe.page_nbytes + 150  # the remote value: the page, its token ids, a header
        ceilings = Ceilings(nbytes, directory, store.url, value_nbytes, pages_per_prefix)
        recompute_ms = a.prefix * PREFILL_MS_PER_TOKEN
        result["recompute_ms"] = recompute_ms
        print(f"\nrecompute: prefill of the vLLM benchmark's model, {a.prefix} tokens: {recompute_ms:.0f} ms")
        bench_gbs = redis_benchmark(store.port, value_nbytes, 4 * pages_per_prefix)
        if bench_gbs is not None:
            print(f"redis-benchmark GET of {value_nbytes} B values (1 client, pipeline 32): {bench_gbs:.2f} GB/s")
            print("  (and right after each remote restore, on 2x its bytes: 'of redis-benchmark' is the median ratio)")

        def reference() -> float | None:
            return redis_benchmark(store.port, value_nbytes, 2 * pages_per_prefix)

        print("ceilings, each timed just before each restore: host a memcpy, disk a read of a cached file,")
        print("remote redis-py MGETs of the same value size; 'of ceiling': median ceiling time / restore time")
        head = f"{'restore ms':>11} {'GB/s':>6} {'ceiling ms':>11} {'of ceiling':>11} {'vs recompute':>13}"
        print(f"\n{'tier':14} {head}")
        try:
            for name in names:
                remote = name.startswith("remote")
                state = PoolState(settings(a, device_pages, **configs[name]))
                if name == "remote-redispy":  # the same tier, its reads through redis-py (pipelined GETEX)
                    tier = state.cache.tier("remote")
                    assert isinstance(tier, RemoteTier)
                    tier.store.reader = None
                try:
                    ceiling = getattr(ceilings, name.split("-")[0])
                    on = cluster if name == "remote-cluster" and cluster is not None else store
                    pairs = await restore_times(state, a, on, ceiling, reference if remote else lambda: None)
                finally:
                    state.close()
                restore, ceilings_s = [p[0] for p in pairs], [p[1] for p in pairs]
                share = statistics.median(c / r for r, c, _ in pairs)
                speedup = recompute_ms / mean_ms(restore)
                gbs = nbytes / statistics.fmean(restore) / 1e9
                figures = f"{mean_ms(restore):11.1f} {gbs:6.2f} {mean_ms(ceilings_s):11.1f} {share:10.0%}"
                refs = [(nbytes / r / 1e9, g) for r, _, g in pairs if g]
                extra = ""
                row = {
                    "name": name,
                    "restore_ms": mean_ms(restore),
                    "restore_gbs": gbs,
                    "ceiling_ms": mean_ms(ceilings_s),
                }
                row |= {"ceiling_gbs": nbytes / statistics.fmean(ceilings_s) / 1e9, "of_ceiling": share}
                row["vs_recompute"] = speedup
                if refs:  # each restore against redis-benchmark run right after it
                    of_bench = statistics.median(mine / g for mine, g in refs)
                    ref_gbs = statistics.median(g for _, g in refs)
                    extra = f"   ({of_bench:.0%} of redis-benchmark at {ref_gbs:.2f} GB/s)"
                    row |= {"reference_gbs": ref_gbs, "of_reference": of_bench}
                result["tiers"].append(row)
                print(f"{name:14} {figures} {speedup:12.1f}x{extra}")
                on.flush()
        finally:
            ceilings.close()
        if "remote-mac" in names:
            wall, cpu = await mac_cost(a, device_pages, store, configs["remote"], configs["remote-mac"])
            print("\nkeyed MAC (KVPOOL_REMOTE_SECRET: AES-GMAC) instead of the checksum, restores paired (order")
            print(
                f"  alternating): wall time {wall:+.0%}, this process's CPU time {cpu:+.0%} (medians; target <= +10%)"
            )
        if "remote" in names:
            writes = write_cost(a, store.url, probe.page_nbytes)
            result["writes"] = writes
            store.flush()
            print(f"\nwrites: a prefix's {pages_per_prefix} pages put to the store, per page (medians, alternating):")
            for name, label in (("own", "kvpool's connection"), ("redis-py", "redis-py's pipeline")):
                wall, cpu = writes[f"{name}_wall_ms_per_page"], writes[f"{name}_cpu_ms_per_page"]
                print(f"  {label:20} {wall:.3f} ms wall, {cpu:.3f} ms CPU of the writing thread")
        if not a.requests:
            return result
        print(f"\nhit rate, {a.requests} uniform draws among {a.prefixes} prefixes (device pool: {a.device_prefixes}):")
        alone = await hit_rate(a, device_pages, {})
        print(f"  device pool alone: {alone:.1%}")
        result["hit_rate"]["device alone"] = alone
        for name in (n for n in ("host", "disk", "remote") if n in names):
            rate = await hit_rate(a, device_pages, configs[name])
            ratio = f"{rate / alone:.1f}x" if alone else "inf"
            print(f"  with the {name} tier: {rate:.1%} ({ratio} the device alone)")
            result["hit_rate"][name] = rate
            store.flush()
    finally:
        store.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return result


def main(a: argparse.Namespace) -> int:
    if a.quick:
        a.layers, a.prefix, a.repeat, a.requests = 2, 512, 2, 16
    torch.set_num_threads(1)
    result = asyncio.run(run(a))
    report.save(result, getattr(a, "json", None), getattr(a, "plot", None))
    return 0
