"""Real redis-server subprocesses on free loopback ports (no persistence), stoppable and restartable:
one server, or a Redis Cluster of three."""

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster

from benchmarks.processes import stop
from tests.conftest import free_port

REDIS_SERVER = shutil.which("valkey-server") or shutil.which("redis-server")
REDIS_CLI = shutil.which("valkey-cli") or shutil.which("redis-cli")


def wait_for_ping(port: int, timeout: float = 20, **tls: Any) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, **tls) as client:
                client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start in {timeout} s") from None
            time.sleep(0.05)


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        assert REDIS_SERVER is not None
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([REDIS_SERVER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_ping(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGKILL)
        self.proc = None

    def client(self) -> "redis.Redis[bytes]":
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    server = RedisServer()
    yield server
    server.stop()


def cluster_port() -> int:
    """A free loopback port P whose cluster bus port (P + 10000) is free too."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", random.randrange(20000, 40000)))
                b.bind(("127.0.0.1", a.getsockname()[1] + 10000))
            except OSError:
                continue
            return int(a.getsockname()[1])
    raise RuntimeError("no free port pair for a cluster node")


def make_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    make = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    subprocess.run(
        [*make, "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


class RedisClusterServers:
    """A real Redis Cluster: `size` primaries (no replicas) on free loopback ports, each node's
    cluster config in a tmp dir so a killed node restarts as itself, with its slots; with tls, every
    node speaks only TLS (clients and the cluster bus), with a self-signed certificate."""

    def __init__(self, directory: Path, size: int = 3, tls: bool = False) -> None:
        self.directory = directory
        self.ports = [cluster_port() for _ in range(size)]
        self.cert = make_cert(directory) if tls else None
        self.tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": str(self.cert[0])} if self.cert else {}
        scheme, query = (
            ("rediss+cluster", f"?ssl_ca_certs={self.tls['ssl_ca_certs']}") if tls else ("redis+cluster", "")
        )
        self.url = f"{scheme}://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + query
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for port in self.ports:
                self.start(port)
            assert REDIS_CLI is not None
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            cli_tls = ["--tls", "--cacert", str(self.cert[0])] if self.cert else []
            subprocess.run(
                [REDIS_CLI, *cli_tls, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.close()
            raise

    def start(self, port: int) -> None:
        assert REDIS_SERVER is not None
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.directory / f"nodes-{port}.conf")]
        args += ["--cluster-node-timeout", "1000", "--dir", str(self.directory)]
        if self.cert is not None:
            args[:2] = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(self.cert[0]), "--tls-key-file", str(self.cert[1])]
            args += ["--tls-ca-cert-file", str(self.cert[0])]
        self.procs[port] = subprocess.Popen([REDIS_SERVER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_ping(port, **self.tls)

    def stop(self, port: int) -> None:
        proc = self.procs.pop(port, None)
        if proc is not None:
            stop(proc, signal.SIGKILL)

    def client(self, port: int) -> "redis.Redis[bytes]":
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, **self.tls)

    def cluster(self) -> "redis.cluster.RedisCluster":
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=2, **self.tls)

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every node says cluster_state:ok (slots all served, nodes agreeing)."""
        deadline = time.monotonic() + timeout
        while not all(self.state(p) == "ok" for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout} s")
            time.sleep(0.1)

    def state(self, port: int) -> str:
        info = self.client(port).execute_command("CLUSTER INFO")  # redis-py >= 5 parses it into a dict
        return str(info["cluster_state"] if isinstance(info, dict) else info)

    def keys(self) -> list[bytes]:
        return [k for p in self.ports for k in self.client(p).keys()]

    def close(self) -> None:
        for port in list(self.procs):
            self.stop(port)


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.fail("redis-server and redis-cli are not installed (apt-get install redis-server; .ci/run does)")
    servers = RedisClusterServers(tmp_path)
    yield servers
    servers.close()


class RedisTLSServer:
    """A redis-server speaking only TLS, with a self-signed certificate for 127.0.0.1 made by openssl."""

    def __init__(self, directory: Path) -> None:
        self.cert, key = make_cert(directory)
        self.port = free_port()
        self.url = f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        assert REDIS_SERVER is not None
        args = ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--tls-cert-file", str(self.cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.cert)]
        args += ["--tls-auth-clients", "no"]
        self.proc = subprocess.Popen([REDIS_SERVER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("redis-server (TLS) did not start in 20 s") from None
                time.sleep(0.05)

    def client(self) -> "redis.Redis[bytes]":
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        stop(self.proc, signal.SIGKILL)


@pytest.fixture
def redis_tls_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    if REDIS_SERVER is None or REDIS_CLI is None or shutil.which("openssl") is None:
        pytest.fail("redis-server, redis-cli and openssl are not installed (apt-get install redis-server openssl)")
    servers = RedisClusterServers(tmp_path, tls=True)
    yield servers
    servers.close()


@pytest.fixture
def redis_tls_server(tmp_path: Path) -> Iterator[RedisTLSServer]:
    if REDIS_SERVER is None or shutil.which("openssl") is None:
        pytest.fail("redis-server and openssl are not installed (apt-get install redis-server openssl)")
    server = RedisTLSServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_unix(tmp_path: Path) -> Iterator[Path]:
    """A redis-server listening on a unix socket only."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    path = tmp_path / "redis.sock"
    args = ["--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([REDIS_SERVER, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(unix_socket_path=str(path), socket_timeout=2).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server (unix socket) did not start in 20 s"
                time.sleep(0.05)
        yield path
    finally:
        stop(proc, signal.SIGKILL)
