"""The CPU pool as a sealed memfd handed over the server's Unix socket (issue 13, finding 2).

Against real `kvpool serve` subprocesses with API keys: the socket gives the descriptor to the tenants that
`GET /v1/ipc` lets through and to nobody else (401 without or with a wrong key, 403 for another tenant, no
descriptor either way); a second process that received it can write pages but neither shrink nor grow the
file (EPERM), and the server keeps serving after the attempt.
"""

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.client import AsyncKVPoolClient, KVPoolClient
from service.core.errors import Forbidden, Unauthorized
from service.ipc.fd_socket import receive_fds
from tests.conftest import REPO, SMALL_POOL, Server
from tests.e2e.test_walkthrough import dense_attention

A, B = "alpha-key-7f3c9b2e41d0", "beta-key-0c8e5a1f93b7"
KEYS = {"KVPOOL_API_KEYS": f"alpha:{A},beta:{B}", "KVPOOL_IPC_TENANTS": "alpha"}


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[Server]:
    server = Server({**SMALL_POOL, **KEYS})
    yield server
    server.stop()


def ipc_of(server: Server, key: str = A) -> dict[str, Any]:
    r = server.client.get("/v1/ipc", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def raw_exchange(path: str, request: bytes) -> tuple[dict[str, Any], list[int]]:
    """One exchange on the socket without the client library: the answer and the descriptors it carried."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(request)
        message, fds, _, _ = socket.recv_fds(sock, 65536, maxfds=16)
    return json.loads(message), fds


def test_the_socket_is_private(keyed_server: Server) -> None:
    path = Path(ipc_of(keyed_server)["socket"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_an_ipc_tenant_attaches_and_writes(keyed_server: Server) -> None:
    with KVPoolClient(keyed_server.url, api_key=A) as client, client.attach() as pool:
        assert pool.kind == "memfd" and pool.blocks.shape == (17, 2, 2, 4, 2, 16)
        client.create_sequence("w")
        slots = client.append("w", 3).slots
        k, v = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
        pool.write(k, v, slots)
        q = torch.randn(3, 4, 16)
        out = client.attend(1, ["w"], q, q_lens=[3])
        torch.testing.assert_close(out.double(), dense_attention(q, k[1], v[1]), atol=1e-5, rtol=1e-5)
        client.free("w")


def test_other_tenants_and_no_key_get_nothing(keyed_server: Server) -> None:
    path = ipc_of(keyed_server)["socket"]
    # HTTP: the route's own answers.
    assert keyed_server.client.get("/v1/ipc", headers={"Authorization": f"Bearer {B}"}).status_code == 403
    assert keyed_server.client.get("/v1/ipc").status_code == 401
    # The socket: the same rule, and no descriptor with the refusal.
    cases = [
        (json.dumps({"api_key": B}).encode() + b"\n", "forbidden"),
        (json.dumps({"api_key": None}).encode() + b"\n", "unauthorized"),
        (json.dumps({"api_key": "not-a-key-of-this-server"}).encode() + b"\n", "unauthorized"),
        (b"\n", "unauthorized"),
        (b"not json\n", "invalid_request"),
    ]
    for request, code in cases:
        answer, fds = raw_exchange(path, request)
        assert fds == [] and answer["error"]["code"] == code, (request, answer)
    answer, fds = raw_exchange(path, json.dumps({"api_key": A}).encode() + b"\n")
    assert len(fds) == 1 and answer["keys"] == ["blocks"]
    os.close(fds[0])
    # The client library raises the typed errors.
    with pytest.raises(Forbidden, match="KVPOOL_IPC_TENANTS"):
        receive_fds(path, B)
    with pytest.raises(Unauthorized, match="need an API key"):
        receive_fds(path, None)
    with pytest.raises(Unauthorized, match="invalid API key"):
        receive_fds(path, "x" * 20)


# Runs in a second process: receives the descriptor as a frontend does, then tries to resize the file.
RESIZER = """
import errno, fcntl, json, os, sys
from service.ipc.fd_socket import receive_fds
path, key = sys.argv[1], sys.argv[2]
answer, fds = receive_fds(path, key)
fd = fds[0]
size = os.fstat(fd).st_size
results = {"size": size, "seals": fcntl.fcntl(fd, fcntl.F_GET_SEALS)}
for name, attempt in (
    ("shrink", lambda: os.ftruncate(fd, 4096)),
    ("grow", lambda: os.ftruncate(fd, size * 2)),
    ("fallocate_grow", lambda: os.posix_fallocate(fd, size, 4096)),
    ("unseal", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)),
):
    try:
        attempt()
        results[name] = "succeeded"
    except OSError as exc:
        results[name] = errno.errorcode[exc.errno]
results["size_after"] = os.fstat(fd).st_size
print(json.dumps(results))
"""


def test_a_receiver_cannot_resize_the_pool(keyed_server: Server) -> None:
    path = ipc_of(keyed_server)["socket"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", RESIZER, path, A], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    size = 17 * 512 * 4
    assert results["size"] == results["size_after"] == size
    assert results["shrink"] == results["grow"] == results["fallocate_grow"] == "EPERM"
    assert results["unseal"] == "EPERM"  # F_SEAL_SEAL: no seal may be added (or removed) any more
    # The server's next K/V write and attention work on the whole pool, its last page included.
    with KVPoolClient(keyed_server.url, api_key=A) as client:
        client.create_sequence("after")
        k, v = torch.randn(2, 64, 2, 16), torch.randn(2, 64, 2, 16)  # every page of the 16-page pool
        assert client.append("after", 64, k=k, v=v).slots[-1] == 63
        q = torch.randn(1, 4, 16)
        out = client.attend(0, ["after"], q)
        torch.testing.assert_close(out.double(), dense_attention(q, k[0], v[0]), atol=1e-5, rtol=1e-5)
        client.free("after")
        assert client.pool()["instance_id"] == ipc_of(keyed_server)["instance_id"]


def test_the_socket_directory_can_be_chosen(start_server: Any, tmp_path: Path) -> None:
    """KVPOOL_IPC_SOCKET_DIR: a volume shared with frontends in other containers."""
    server = start_server({"KVPOOL_IPC_SOCKET_DIR": str(tmp_path)})
    path = Path(server.client.get("/v1/ipc").json()["socket"])
    assert path.parent.parent == tmp_path and path.is_socket()
    with KVPoolClient(server.url) as client, client.attach() as pool:
        assert pool.kind == "memfd"
    server.stop()
    assert list(tmp_path.iterdir()) == []


def test_the_async_client_attaches_with_its_key(keyed_server: Server) -> None:
    async def attach(key: str) -> str:
        async with AsyncKVPoolClient(keyed_server.url, api_key=key) as client:
            with await client.attach() as pool:
                return f"{pool.kind} {pool.blocks.shape[0]}"

    assert asyncio.run(attach(A)) == "memfd 17"
    with pytest.raises(Forbidden):
        asyncio.run(attach(B))
