"""What tests/chaos/test_fuzz.py sends: hypothesis strategies for bodies no schema describes, raw
requests over a socket (paths exactly as written: httpx would resolve dot segments), and the pool's
state to compare before and after a refused call.

Not a test module.
"""

import base64
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx
import hypothesis.strategies as st
import numpy as np

# -- valid bodies, to break one field at a time --------------------------------------------------


def tensor(shape: list[int], fill: float = 0.5, dtype: str = "float32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(np.full(shape, fill, dtype).tobytes()).decode()}


# On the small pool (2 layers, 2 KV heads, head_dim 16); the fixture's sequences are s0..s3.
TEMPLATES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/sequences"): {"seq_id": "new", "token_ids": [1, 2, 3, 4, 5], "ttl_s": 30.0, "cache_salt": "x"},
    ("POST", "/v1/sequences/s3/append"): {
        "num_tokens": 2,
        "token_ids": [7, 8],
        "k": tensor([2, 2, 2, 16]),
        "v": tensor([2, 2, 2, 16], -0.5),
    },
    ("POST", "/v1/sequences/s0/fork"): {"seq_id": "child"},
    ("POST", "/v1/step"): {
        "appends": [{"seq_id": "s3", "num_tokens": 1, "token_ids": [9]}],
        "seq_ids": ["s3", "s0"],
        "format": "flashinfer",
    },
    ("POST", "/v1/attend"): {
        "layer": 1,
        "seq_ids": ["s0", "s3"],
        "q": tensor([3, 4, 16]),
        "q_lens": [2, 1],
        "k": tensor([3, 2, 16]),
        "v": tensor([3, 2, 16], 0.25),
        "scale": 0.25,
        "sliding_window": 4,
        "softcap": 30.0,
    },
}
ROUTES = [
    *TEMPLATES,
    ("GET", "/v1/pool"),
    ("GET", "/v1/ipc"),
    ("GET", "/v1/sequences/s0"),
    ("DELETE", "/v1/sequences/s2"),
]

# -- strategies ----------------------------------------------------------------------------------
FIELD_NAMES = sorted({k for body in TEMPLATES.values() for k in body} | {"dtype", "shape", "data", "seq_id"})
HUGE = [2**31, 2**32 + 1, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 5e-324]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(HUGE)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["s0", "s1", "s3", ".", "..", "", "float32", "bfloat16", "int8", "AAAA", "max", "nope"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=16,
)
# Replacements aimed at the tensor codec and the fields' ranges.
BAD_TENSOR_PARTS = {
    "dtype": ["float64", "int8", "bool", "", "FLOAT32", "float32 ", "uint32", "int64", "bfloat16", "float16", 3],
    "shape": [[], [-1], [0, 4, 16], [2**31 + 1], [2**40, 4, 16], [1] * 9, [3, 4, 16, 1], [3, 4.0, 16], ["3"], None],
    "data": ["", "!!!!", "AAA", "A" * 8000, "====", "AA==AA==", "AAAA\nAAAA", "\u00e9\u00e9\u00e9\u00e9", None, 12],
}


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a JSON value (the root excluded)."""
    found: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        found.append((*prefix, key))
        found.extend(paths(child, (*prefix, key)))
    return found


@st.composite
def broken_bodies(draw: Any, template: dict[str, Any]) -> Any:
    """`template` with one field replaced (by any JSON value, or one aimed at tensors), removed, or
    an unknown field added."""
    body = json.loads(json.dumps(template))
    where = draw(st.sampled_from(paths(body)))
    parent = body
    for key in where[:-1]:
        parent = parent[key]
    key = where[-1]
    op = draw(st.sampled_from(["replace", "replace", "aimed", "delete", "add"]))
    if op == "aimed" and key in BAD_TENSOR_PARTS:
        parent[key] = draw(st.sampled_from(BAD_TENSOR_PARTS[key]))
    elif op == "delete" and isinstance(parent, dict):
        del parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    else:
        parent[key] = draw(json_values)
    return body


def truncations(template: dict[str, Any]) -> st.SearchStrategy[bytes]:
    raw = json.dumps(template).encode()
    return st.integers(0, len(raw) - 1).map(lambda n: raw[:n])


# -- raw requests --------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_request(
    port: int, method: str, target: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> Answer:
    """One HTTP/1.1 request with the target exactly as given, on its own connection."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    return Answer(int(status_line.split()[1]), parsed, rest)


# -- the pool's state, and the figures ------------------------------------------------------------
def pool_state(clients: dict[str, httpx.Client], seq_ids: dict[str, list[str]]) -> Any:
    """The pool's counts, and the length and pages of each tenant's known sequences (None: gone)."""
    any_client = next(iter(clients.values()))
    pool = any_client.get("/v1/pool").json()
    counts = tuple(pool[k] for k in ("pages_used", "pages_cached", "pages_free", "num_sequences"))
    seqs = {}
    for tenant, ids in seq_ids.items():
        for seq_id in ids:
            r = clients[tenant].get(f"/v1/sequences/{seq_id}")
            seqs[tenant, seq_id] = (r.json()["length"], r.json()["block_table"]) if r.status_code == 200 else None
    return counts, seqs


def check_envelope(status: int, body: bytes) -> None:
    """An error answer is exactly {"error": {"code", "message"[, "details"]}}, code and message non-empty."""
    envelope = json.loads(body)
    assert isinstance(envelope, dict) and set(envelope) == {"error"}, envelope
    error = envelope["error"]
    assert set(error) - {"details"} == {"code", "message"}, envelope
    assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str) and error["message"]
    if status >= 500:
        assert (status, error["code"]) == (507, "out_of_pages"), envelope


@dataclass
class Figures:
    name: str
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    server_errors: int = 0
    crashes: int = 0
    leaks: int = 0
    hangs: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    def line(self) -> str:
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return (
            f"chaos fuzz {self.name}: {self.tried} inputs, {self.server_errors} 5xx, {self.crashes} crashes, "
            f"{self.leaks} leaks, {self.hangs} hangs ({self.refused} refused, {self.accepted} accepted; {codes})"
        )
