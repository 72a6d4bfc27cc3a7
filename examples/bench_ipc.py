"""K/V into the pool over HTTP (append with k/v as base64 JSON) versus through the mapped pool.

    python -m examples.bench_ipc [--tokens 256] [--repeat 20]

Starts its own `kvpool serve` on the CPU (Llama-3-8B-like geometry scaled down: 8 layers, 8 KV heads
of 128, page 16, float16) and prints the median time per append of `--tokens` tokens of every layer.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from service.client import KVPoolClient

REPO = Path(__file__).resolve().parent.parent
GEOMETRY = {"KVPOOL_NUM_LAYERS": "8", "KVPOOL_NUM_KV_HEADS": "8", "KVPOOL_HEAD_DIM": "128", "KVPOOL_PAGE_SIZE": "16"}


def start_server(port: int, num_pages: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **GEOMETRY, "KVPOOL_DTYPE": "float16", "KVPOOL_DEVICE": "cpu"}
    env["KVPOOL_NUM_PAGES"] = str(num_pages)
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(cmd, env=env, cwd=REPO)


def wait_ready(client: KVPoolClient, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"kvpool serve exited with {proc.returncode}")
        try:
            client.readyz()
            return
        except Exception:
            time.sleep(0.1)
    raise SystemExit("kvpool serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    layers, heads, dim = (int(GEOMETRY[k]) for k in ("KVPOOL_NUM_LAYERS", "KVPOOL_NUM_KV_HEADS", "KVPOOL_HEAD_DIM"))
    pages_per_round = -(-args.tokens // 16)
    proc = start_server(args.port, 2 * pages_per_round * args.repeat + 8)
    try:
        with KVPoolClient(f"http://127.0.0.1:{args.port}", timeout=120) as client:
            wait_ready(client, proc)
            k = torch.randn(layers, args.tokens, heads, dim, dtype=torch.float16)
            v = torch.randn_like(k)
            nbytes = 2 * k.numel() * k.element_size()
            http, ipc = [], []
            with client.attach() as pool:
                for i in range(args.repeat):
                    client.create_sequence(f"h{i}")
                    t0 = time.perf_counter()
                    client.append(f"h{i}", args.tokens, k=k, v=v)
                    http.append(time.perf_counter() - t0)
                    client.create_sequence(f"i{i}")
                    t0 = time.perf_counter()
                    step = client.step([(f"i{i}", args.tokens)])
                    pool.write(k, v, step.slots[0])
                    ipc.append(time.perf_counter() - t0)
                    # same bytes in the pool either way
                    assert torch.equal(pool.read(step.slots[0])[0], k)
        for name, times in (("HTTP append with k/v (JSON)", http), ("step + write through the mapped pool", ipc)):
            t = statistics.median(times)
            print(f"{name:40s} {t * 1e3:8.2f} ms   {nbytes / t / 2**30:6.2f} GiB/s   ({nbytes / 2**20:.1f} MiB)")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
