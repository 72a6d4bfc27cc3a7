"""The pool's descriptors, handed to authenticated local processes over a Unix-domain socket (SCM_RIGHTS).

The exchange is one line each way. The client sends `{"api_key": <key or null>}`; the server answers
`{"instance_id", "keys": [...]}` with one descriptor per pool tensor attached (in the order of `keys`), or an
error envelope `{"error": {"code", "message"}}` with none. Who may have them is decided by the same rule as
`GET /v1/ipc` (the `authorize` callable the server passes in). The socket file is the owner's only (0600, in a
private 0700 directory under $XDG_RUNTIME_DIR or the temporary directory) and removed when the server closes.
A malformed line (not JSON, nested deeper than orjson's 1,024 levels, longer than MAX_LINE, `api_key` not a
string) is answered `invalid_request`; connections, deadlines and the one reply per connection are
service/ipc/line_server.py's.
"""

import json
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from typing import Any

import orjson

from service.core.errors import InvalidRequest, KVPoolError
from service.ipc.line_server import LineServer, error_line
from service.wire.errors import error_from_envelope, status_of

MAX_LINE = 4096  # bytes of a request line; a longer one is answered invalid_request
TIMEOUT_S = 5.0  # a client's wait for the answer; the server's default deadline for the whole request line
MAX_CONNECTIONS = 32  # frontends on the node ask once each at start: a handful at a time


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


def _line(obj: Any) -> list[bytes]:
    return [json.dumps(obj).encode() + b"\n"]


def parse_request(line: bytes) -> str | None:
    """The api_key of a request line (None when absent or null): a JSON object whose `api_key` is a string or
    null. Anything else is InvalidRequest; orjson bounds the nesting (1,024 levels) without recursing in Python."""
    try:
        request = orjson.loads(line or b"{}")
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidRequest('the request must be a JSON object: {"api_key": <key or null>}')
    key = request.get("api_key")
    if key is not None and not isinstance(key, str):
        raise InvalidRequest("api_key must be a string or null")
    return key


class FdServer:
    """Serves `fds` (named `keys`) to clients that `authorize(api_key)` lets through (it raises a KVPoolError).

    The socket runs under the rules of service/ipc/line_server.py: at most `max_connections` open (the oldest
    is closed first), the whole line within `line_timeout_s`, one reply line to every connection.
    """

    def __init__(
        self,
        fds: list[int],
        keys: list[str],
        instance_id: str,
        authorize: Callable[[str | None], None],
        parent: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        line_timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.fds, self.keys, self.instance_id, self.authorize = fds, keys, instance_id, authorize
        parent = os.path.abspath(parent or runtime_dir() or tempfile.gettempdir())  # clients run elsewhere
        remove_stale(parent)
        self.directory = tempfile.mkdtemp(prefix="kvpool-", dir=parent)  # mode 0700
        self.path = os.path.join(self.directory, "ipc.sock")
        try:
            self.server = LineServer(self.path, self.answer, max_connections, line_timeout_s, MAX_LINE)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise

    def answer(self, line: bytes) -> tuple[bytes, list[int]]:
        """The reply to one request line, and the descriptors to attach (none with an error)."""
        try:
            self.authorize(parse_request(line))
        except KVPoolError as exc:
            return error_line(exc.code, str(exc)), []
        return _line({"instance_id": self.instance_id, "keys": self.keys})[0], self.fds

    def close(self) -> None:
        """Stop serving and remove the socket file and its directory (idempotent)."""
        self.server.close()
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
