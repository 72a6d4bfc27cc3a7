"""Zero-copy sharing: another OS process maps the pool through GET /v1/ipc and writes K/V in place.

The server's attention must see exactly what the other process wrote. A CPU pool is a sealed memfd
(tests/ipc/test_memfd.py) unless KVPOOL_SHARED_MEMORY=posix_shm forces the fallback, a /dev/shm segment
that must be gone once the server stops.
"""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.client import KVPoolClient
from service.core.errors import SequenceNotFound
from service.ipc.attach import AttachedPool, PoolLost
from service.ipc.cuda_ipc import expandable_segments_enabled
from tests.conftest import REPO, SMALL_POOL, Server, free_port
from tests.e2e.test_walkthrough import dense_attention

# Runs in a second process: bookkeeping over HTTP, K/V written through the mapped pool, and the
# written tensors saved for the test to compute attention from.
WRITER = """
import sys, torch
from service.client import KVPoolClient
from service.core.errors import SequenceNotFound
from service.ipc.cuda_ipc import expandable_segments_enabled

url, out_path = sys.argv[1], sys.argv[2]
torch.manual_seed(int(sys.argv[3]))
with KVPoolClient(url) as client, client.attach() as pool:
    _, _, num_layers, _, heads, dim = pool.blocks.shape
    step = client.step([("a", 6), ("b", 3)])
    kv = {}
    for seq_id, slots in zip(("a", "b"), step.slots):
        k, v = torch.randn(num_layers, len(slots), heads, dim), torch.randn(num_layers, len(slots), heads, dim)
        pool.write(k, v, slots)  # every layer at once
        kv[seq_id] = [k, v]
    ext = client.append("a", 1)  # one decode token, written one layer at a time
    k1, v1 = torch.randn(num_layers, 1, heads, dim), torch.randn(num_layers, 1, heads, dim)
    for layer in range(num_layers):
        pool.write(k1[layer], v1[layer], ext.slots, layer=layer)
    kv["a"] = [torch.cat([kv["a"][0], k1], 1), torch.cat([kv["a"][1], v1], 1)]
    torch.save({"kv": kv, "slots": [*step.slots, ext.slots], "device": str(pool.device)}, out_path)
print("written")
"""


@pytest.fixture(scope="module")
def cpu_server() -> Iterator[Server]:
    """One server shared by the tests that do not stop it (a start costs seconds on a busy CPU)."""
    server = Server(SMALL_POOL)
    yield server
    server.stop()


def run_writer(url: str, tmp_path: Path, seed: int) -> dict[str, Any]:
    out = tmp_path / "written.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, url, str(out), str(seed)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("written"), proc.stdout
    written: dict[str, Any] = torch.load(out)
    return written


def test_second_process_writes_and_server_attends(cpu_server: Server, tmp_path: Path) -> None:
    check_cross_process(cpu_server, tmp_path, "cpu")


@pytest.mark.gpu
def test_second_process_writes_and_server_attends_cuda(start_server: Any, tmp_path: Path) -> None:
    """The same through a CUDA IPC handle: the writer opens the server's GPU memory in its own process."""
    server = start_server({"KVPOOL_DEVICE": "cuda"})
    assert server.client.get("/v1/ipc").json()["kind"] == "cuda_ipc"
    check_cross_process(server, tmp_path, "cuda")


def check_cross_process(server: Server, tmp_path: Path, device: str) -> None:
    with KVPoolClient(server.url) as client:
        for seq_id in ("a", "b"):
            client.create_sequence(seq_id)
        written = run_writer(server.url, tmp_path, seed=1)
        assert written["device"].startswith(device)
        # page size 4: "a" holds pages 0-1, "b" page 2; a's seventh token lands in page 1
        assert written["slots"] == [[0, 1, 2, 3, 4, 5], [8, 9, 10], [6]]
        (ka, va), (kb, vb) = written["kv"]["a"], written["kv"]["b"]
        torch.manual_seed(2)
        for layer in range(2):
            q = torch.randn(5, 4, 16)  # 3 queries for "a" (positions 4-6), 2 for "b" (positions 1-2)
            out = client.attend(layer, ["a", "b"], q, q_lens=[3, 2])
            expected = torch.cat(
                [dense_attention(q[:3], ka[layer], va[layer]), dense_attention(q[3:], kb[layer], vb[layer])]
            )
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)

        # This process maps the same memory and reads back exactly the other process's bytes.
        with client.attach() as pool:
            k, v = pool.read([0, 1, 2, 3, 4, 5, 6])
            assert torch.equal(k.cpu(), ka) and torch.equal(v.cpu(), va)
            k, v = pool.read([8, 9, 10], layer=1)
            assert torch.equal(k.cpu(), kb[1]) and torch.equal(v.cpu(), vb[1])
            assert not pool.blocks[-1].any(), "the null page must stay zero"
        for seq_id in ("a", "b"):
            client.free(seq_id)


POSIX_SHM = {"KVPOOL_SHARED_MEMORY": "posix_shm"}  # the fallback, forced


def test_ipc_description_matches_pool(cpu_server: Server) -> None:
    with KVPoolClient(cpu_server.url) as client:
        ipc, ready = client.ipc(), client.readyz()
    assert ipc["kind"] == "memfd" and ipc["instance_id"] == ready["instance_id"]
    blocks = ipc["blocks"]
    assert blocks["dtype"] == "float32"
    assert blocks["shape"] == [17, 2, 2, 4, 2, 16] and blocks["strides"] == [512, 256, 128, 32, 16, 1]
    assert blocks["handle"] == {"fd_index": 0, "offset": 0, "nbytes": 17 * 512 * 4}
    assert Path(ipc["socket"]).is_socket()
    assert not [n for n in os.listdir("/dev/shm") if ready["instance_id"][:16] in n]


def test_posix_shm_fallback_description_matches_pool(start_server: Any) -> None:
    server = start_server(POSIX_SHM)
    with KVPoolClient(server.url) as client:
        ipc, ready = client.ipc(), client.readyz()
    assert ipc["kind"] == "posix_shm" and ipc["instance_id"] == ready["instance_id"] and "socket" not in ipc
    handle = ipc["blocks"]["handle"]
    assert handle["name"] == f"kvpool-{ready['instance_id'][:16]}-blocks"
    assert (handle["offset"], handle["nbytes"]) == (0, 17 * 512 * 4)
    assert (Path("/dev/shm") / handle["name"]).stat().st_size == 17 * 512 * 4
    with KVPoolClient(server.url) as client, client.attach() as pool:
        assert pool.kind == "posix_shm" and pool.blocks.shape == (17, 2, 2, 4, 2, 16)


def test_writes_through_the_view_are_validated(cpu_server: Server) -> None:
    with KVPoolClient(cpu_server.url) as client, client.attach() as pool:
        before = pool.blocks.clone()
        k = torch.randn(2, 1, 2, 16)
        with pytest.raises(ValueError, match="outside the pool's 64 writable slots"):
            pool.write(k, k, [64])  # slot 64 is the null page's first
        with pytest.raises(ValueError, match="outside"):
            pool.write(k, k, [-1])
        with pytest.raises(ValueError, match=r"k must have shape \[2, 2, 2, 16\]"):
            pool.write(k, k, [0, 1])
        with pytest.raises(ValueError, match=r"must have shape \[1, 2, 16\]"):
            pool.write(k, k, [0], layer=0)
        assert torch.equal(pool.blocks, before)


def _segment_of(server: Server) -> Path:
    """posix_shm: the segment in /dev/shm; memfd: the socket file that hands out its descriptor."""
    ipc = server.client.get("/v1/ipc").json()
    if ipc["kind"] == "memfd":
        return Path(ipc["socket"])
    return Path("/dev/shm") / ipc["blocks"]["handle"]["name"]


@pytest.mark.parametrize("env", [{}, POSIX_SHM], ids=["memfd", "posix_shm"])
def test_sigterm_unlinks_the_segment_and_a_restart_is_detected(start_server: Any, env: dict[str, str]) -> None:
    first = start_server(env)
    segment = _segment_of(first)
    with KVPoolClient(first.url) as client, client.attach() as pool:
        client.check_attached(pool)
        pool.blocks[0, 0, 0, 0, 0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        assert first.stop(signal.SIGTERM) in (0, -signal.SIGTERM)  # uvicorn shuts down, then re-raises
        assert not segment.exists()
        # Unlinked, not unmapped: this process's view stays valid until it lets go.
        assert pool.blocks[0, 0, 0, 0, 0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]
        second = start_server()
        with KVPoolClient(second.url) as other, pytest.raises(PoolLost, match="restarted") as info:
            other.check_attached(pool)
        assert info.value.code == "pool_lost"
        with pytest.raises(FileNotFoundError, match="must run on this machine"):
            AttachedPool(pool.description)  # the first server's segment (or socket) is gone
        if not env:
            assert not segment.parent.exists()  # the socket's private directory too


def test_sigint_unlinks_the_segment(start_server: Any) -> None:
    server = start_server(POSIX_SHM)
    segment = _segment_of(server)
    assert segment.exists()
    assert server.stop(signal.SIGINT) in (0, -signal.SIGINT)
    assert not segment.exists()


def test_segment_is_reclaimed_even_after_sigkill(start_server: Any) -> None:
    """The watchdog (a separate process) unlinks what a killed server left registered."""
    server = start_server(POSIX_SHM)
    segment = _segment_of(server)
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 20
    while segment.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not segment.exists()


def test_the_documented_frontend_example_runs(cpu_server: Server) -> None:
    page = (REPO / "docs" / "frontends.md").read_text()
    section = page.split("# Using kvpool from a frontend process", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "client.attach()" in code and "pool.write(" in code
    exec(compile(code.replace("http://127.0.0.1:8000", cpu_server.url), "docs/frontends.md", "exec"), {})
    with KVPoolClient(cpu_server.url) as client, pytest.raises(SequenceNotFound):
        client.get_sequence("req-1")  # the example freed what it allocated


@pytest.mark.parametrize(
    ("conf", "enabled"),
    [
        ("", False),
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:true", True),
        ("expandable_segments:False", False),
    ],
)
def test_expandable_segments_detection(monkeypatch: pytest.MonkeyPatch, conf: str, enabled: bool) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert expandable_segments_enabled() is enabled


def serve_expecting_refusal(env: dict[str, str]) -> str:
    """Run `kvpool serve` that must refuse to start: exit status 2; returns its output."""
    cmd = [sys.executable, "-m", "service", "serve", "--port", str(free_port())]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **SMALL_POOL, **env}
    proc = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr


@pytest.mark.gpu
def test_expandable_segments_are_refused_at_start() -> None:
    err = serve_expecting_refusal({"KVPOOL_DEVICE": "cuda", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "cannot start" in err and "expandable_segments" in err


def test_a_pool_larger_than_dev_shm_is_refused_at_start() -> None:
    """Refused up front (a tmpfs that fills up later kills the server with SIGBUS on a write)."""
    st = os.statvfs("/dev/shm")
    page_nbytes = 2 * 8 * 4 * 2 * 1024 * 4
    num_pages = st.f_bavail * st.f_frsize // page_nbytes + 1024
    before = set(os.listdir("/dev/shm"))
    env = {"KVPOOL_NUM_LAYERS": "8", "KVPOOL_HEAD_DIM": "1024", "KVPOOL_NUM_PAGES": str(num_pages), **POSIX_SHM}
    err = serve_expecting_refusal(env)
    assert re.search(r"cannot start: the pool needs .* GiB of shared memory", err) and "--shm-size" in err
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvpool-")}


def test_a_memfd_pool_larger_than_memory_is_refused_at_start() -> None:
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    page_nbytes = 2 * 8 * 4 * 2 * 1024 * 4
    env = {"KVPOOL_NUM_LAYERS": "8", "KVPOOL_HEAD_DIM": "1024", "KVPOOL_NUM_PAGES": str(available // page_nbytes * 2)}
    err = serve_expecting_refusal(env)
    assert re.search(r"cannot start: the pool needs .* GiB of shared memory but the machine cannot hold it", err)
