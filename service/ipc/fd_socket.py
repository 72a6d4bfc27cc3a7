"""The pool's descriptors, handed to authenticated local processes over a Unix-domain socket (SCM_RIGHTS).

The exchange is one line each way. The client sends `{"api_key": <key or null>}`; the server answers
`{"instance_id", "keys": [...]}` with one descriptor per pool tensor attached (in the order of `keys`), or an
error envelope `{"error": {"code", "message"}}` with none. Who may have them is decided by the same rule as
`GET /v1/ipc` (the `authorize` callable the server passes in). The socket file is the owner's only (0600, in a
private 0700 directory under $XDG_RUNTIME_DIR or the temporary directory) and removed when the server closes.
"""

import json
import os
import shutil
import socket
import socketserver
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from service.core.errors import KVPoolError
from service.wire.errors import error_from_envelope, status_of

MAX_LINE = 4096
TIMEOUT_S = 5.0


def runtime_dir() -> str | None:
    """$XDG_RUNTIME_DIR when it is a private directory of ours, else None (the temporary directory)."""
    path = os.environ.get("XDG_RUNTIME_DIR")
    if path and os.path.isdir(path) and os.access(path, os.W_OK):
        return path
    return None


def remove_stale(parent: str, min_age_s: float = 10.0) -> list[str]:
    """Remove the socket directories of servers that died without closing (a kill): ours, `kvpool-*`, holding
    only `ipc.sock`, which refuses connections and is older than `min_age_s` (a socket that a starting server
    has bound but not yet listens on refuses too, for a moment). Returns the directories removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith("kvpool-")]
    except OSError:
        return removed
    for name in names:
        directory = os.path.join(parent, name)
        path = os.path.join(directory, "ipc.sock")
        try:
            info = os.lstat(directory)
            if info.st_uid != os.getuid() or os.listdir(directory) != ["ipc.sock"]:
                continue
            sock_info = os.lstat(path)
            if not stat.S_ISSOCK(sock_info.st_mode) or time.time() - sock_info.st_mtime < min_age_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(path)
            continue  # a live server
        except ConnectionRefusedError:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
        except OSError:
            continue
    return removed


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(MAX_LINE - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) >= MAX_LINE:
            raise ValueError(f"the request is longer than {MAX_LINE} bytes")
    return data.split(b"\n", 1)[0]


def _line(obj: Any) -> list[bytes]:
    return [json.dumps(obj).encode() + b"\n"]


class FdServer:
    """Serves `fds` (named `keys`) to clients that `authorize(api_key)` lets through (it raises a KVPoolError)."""

    def __init__(
        self,
        fds: list[int],
        keys: list[str],
        instance_id: str,
        authorize: Callable[[str | None], None],
        parent: str | None = None,
    ) -> None:
        self.fds, self.keys, self.instance_id, self.authorize = fds, keys, instance_id, authorize
        parent = os.path.abspath(parent or runtime_dir() or tempfile.gettempdir())  # clients run elsewhere
        remove_stale(parent)
        self.directory = tempfile.mkdtemp(prefix="kvpool-", dir=parent)  # mode 0700
        self.path = os.path.join(self.directory, "ipc.sock")
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer.answer(self.request)

        self.server = socketserver.ThreadingUnixStreamServer(self.path, Handler, bind_and_activate=False)
        self.server.daemon_threads = True
        try:
            self.server.server_bind()
            os.chmod(self.path, 0o600)
            self.server.server_activate()
        except BaseException:
            self.server.server_close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvpool-ipc-socket", daemon=True)
        self.thread.start()

    def answer(self, conn: socket.socket) -> None:
        conn.settimeout(TIMEOUT_S)
        fds: list[int] = []
        try:
            request = json.loads(_read_line(conn) or b"{}")
            key = request.get("api_key") if isinstance(request, dict) else None
            self.authorize(key if isinstance(key, str) else None)
        except KVPoolError as exc:
            reply = _line({"error": {"code": exc.code, "message": str(exc)}})
        except (OSError, ValueError) as exc:  # a timeout, a reset, not JSON: nothing is sent but this
            reply = _line({"error": {"code": "invalid_request", "message": str(exc)}})
        else:
            reply, fds = _line({"instance_id": self.instance_id, "keys": self.keys}), self.fds
        try:
            if fds:
                socket.send_fds(conn, reply, fds)
            else:
                conn.sendall(reply[0])
        except OSError:  # the client left first (a broken pipe, a reset, the timeout): no one to tell
            pass

    def close(self) -> None:
        """Stop serving and remove the socket file and its directory (idempotent)."""
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.directory, ignore_errors=True)


def receive_fds(path: str, api_key: str | None, timeout: float = TIMEOUT_S) -> tuple[dict[str, Any], list[int]]:
    """Ask the server at `path` for the pool's descriptors: (its answer, the descriptors, which the caller closes).

    An error answer is raised as its typed exception (401 `unauthorized`, 403 `forbidden`).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise FileNotFoundError(
                f"the pool's IPC socket {path!r} does not exist: the server must run on this machine "
                "(and still be running)"
            ) from None
        sock.sendall(_line({"api_key": api_key})[0])
        message, fds, _, _ = socket.recv_fds(sock, 65536, maxfds=16)
    try:
        answer = json.loads(message)
        if "error" in answer:
            error = answer["error"]
            raise error_from_envelope(status_of(error["code"]), error["code"], error["message"])
        if len(fds) != len(answer["keys"]):
            raise ValueError(f"the server sent {len(fds)} descriptors for {len(answer['keys'])} pool tensors")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return answer, fds
