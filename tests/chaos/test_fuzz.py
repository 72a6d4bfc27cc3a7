"""Malformed input against a live `kvpool serve` (two tenants with keys), every route: JSON of any
shape, valid bodies with one field broken (wrong types, huge numbers, NaN, bad base64, wrong dtypes
and shapes), raw bytes (truncated JSON, deep nesting, NaN literals, other encodings, oversize bodies)
and path tricks (dot segments, percent-encoding, other spellings, with and without a key).

After each refused call the pool must be as before it (counts, and every known sequence's length
and pages, the other tenant's too); every refusal is the error envelope; no 5xx but 507
`out_of_pages`; no hang; the server alive at the end. tests/e2e/test_schemathesis.py generates from
the OpenAPI schema; this sends what no schema describes and compares the pool around each call.
Generation is derandomized, so CI runs the same inputs every time; each test prints its figures.
"""

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, unquote

import httpx
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from tests.chaos.fuzz_inputs import (
    ROUTES,
    TEMPLATES,
    Figures,
    broken_bodies,
    check_envelope,
    json_values,
    pool_state,
    raw_request,
    tensor,
    truncations,
)
from tests.chaos.tally import TALLY
from tests.conftest import SMALL_POOL, Server

KEYS = {"fuzz": "fuzz-key-0123456789abcdef", "other": "other-key-0123456789abcdef"}
LIMIT = 65536
ENV = {
    **SMALL_POOL,
    "KVPOOL_NUM_PAGES": "32",
    "KVPOOL_API_KEYS": ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items()),
    "KVPOOL_MAX_REQUEST_BYTES": str(LIMIT),
}
SEEDS = {"fuzz": ["s0", "s1", "s2", "s3"], "other": ["s0"]}
JSON = {"content-type": "application/json"}
READS = ("GET", "HEAD", "OPTIONS")
OPEN = ("/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/redoc")


def fuzz_settings(max_examples: int) -> Any:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


class Live:
    """The server, a client per tenant, the known sequences and the state they should be in."""

    def __init__(self) -> None:
        self.server = Server(ENV)
        self.clients = {
            tenant: httpx.Client(base_url=self.server.url, timeout=10, headers={"Authorization": f"Bearer {key}"})
            for tenant, key in KEYS.items()
        }
        self.created: list[str] = []
        self.seed()
        self.baseline = pool_state(self.clients, SEEDS)

    def seed(self) -> None:
        c, other = self.clients["fuzz"], self.clients["other"]
        kv = {"k": tensor([2, 6, 2, 16], 0.1), "v": tensor([2, 6, 2, 16], 0.2)}
        assert c.post("/v1/sequences", json={"seq_id": "s0", "token_ids": [1, 2, 3, 4, 5, 6]}).status_code == 201
        assert c.post(
            "/v1/sequences/s0/append", json={"num_tokens": 6, "token_ids": [1, 2, 3, 4, 5, 6], **kv}
        ).is_success
        assert c.post("/v1/sequences/s0/fork", json={"seq_id": "s1"}).status_code == 201
        assert c.post("/v1/sequences", json={"seq_id": "s2"}).status_code == 201
        assert c.post("/v1/sequences", json={"seq_id": "s3"}).status_code == 201
        assert c.post("/v1/sequences/s3/append", json={"num_tokens": 3}).is_success
        assert other.post("/v1/sequences", json={"seq_id": "s0"}).status_code == 201
        assert other.post("/v1/sequences/s0/append", json={"num_tokens": 2}).is_success

    def reset(self) -> None:
        """Back to the seeded state after an accepted call changed it."""
        for tenant, ids in SEEDS.items():
            for seq_id in ids + (self.created if tenant == "fuzz" else []):
                self.clients[tenant].delete(f"/v1/sequences/{quote(seq_id, safe='')}")
        self.created.clear()
        pool = self.clients["fuzz"].get("/v1/pool").json()
        assert (pool["num_sequences"], pool["pages_used"]) == (0, 0), pool
        self.seed()
        self.baseline = pool_state(self.clients, SEEDS)

    def send(
        self, figures: Figures, method: str, path: str, body: bytes | Iterator[bytes], headers: dict[str, str]
    ) -> None:
        """The body as given (an iterator: chunked, without a Content-Length)."""
        what = f"{method} {path} {body[:300] if isinstance(body, bytes) else 'chunked'!r}"
        try:
            r = self.clients["fuzz"].request(method, path, content=body, headers=headers)
        except httpx.TimeoutException:
            figures.hangs += 1
            raise AssertionError(f"no answer in 10 s: {what}") from None
        self.judge(figures, method, r.status_code, r.content, what)

    def judge(self, figures: Figures, method: str, status: int, body: bytes, what: str) -> None:
        figures.tried += 1
        figures.statuses[status] = figures.statuses.get(status, 0) + 1
        if self.server.proc.poll() is not None:
            figures.crashes += 1
            raise AssertionError(f"the server died after {what}")
        if status >= 500 and status != 507:
            figures.server_errors += 1
        if status >= 400:
            figures.refused += 1
            check_envelope(status, body)
            # A refused read is held to the pool's counts; anything else to every known sequence too.
            after = pool_state(self.clients, {} if method in READS else SEEDS)
            if method in READS:
                after = (after[0], self.baseline[1])
            if after != self.baseline:
                figures.leaks += 1
                before = self.baseline
                self.reset()  # hypothesis replays inputs to shrink this one: each is judged on a clean pool
                raise AssertionError(f"{what} was refused with {status} but changed the pool:\n{before}\n{after}")
            return
        figures.accepted += 1
        if status == 201:
            self.created.append(json.loads(body)["seq_id"])
        if method != "GET" and not what.startswith("POST /v1/attend"):
            self.reset()

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.server.stop()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    live = Live()
    yield live
    alive = live.server.proc.poll() is None and live.clients["fuzz"].get("/healthz").status_code == 200
    live.close()
    assert alive, "the server did not survive the fuzzing"


def finish(figures: Figures) -> None:
    print(figures.line())
    failures = figures.server_errors + figures.crashes + figures.leaks + figures.hangs
    TALLY.record("HTTP malformed input", malformed=figures.tried, failures=failures, held=figures.line())
    assert (figures.server_errors, figures.crashes, figures.leaks, figures.hangs) == (0, 0, 0, 0), figures.line()


def test_json_of_any_shape_to_every_route(live: Live) -> None:
    figures = Figures("any JSON")

    @fuzz_settings(150)
    @given(route=st.sampled_from(ROUTES), body=json_values)
    def run(route: tuple[str, str], body: Any) -> None:
        live.send(figures, *route, json.dumps(body, allow_nan=True).encode(), JSON)

    run()
    finish(figures)


def test_valid_bodies_with_one_field_broken(live: Live) -> None:
    figures = Figures("one field broken")

    @fuzz_settings(200)
    @given(data=st.data())
    def run(data: Any) -> None:
        route = data.draw(st.sampled_from(list(TEMPLATES)))
        body = data.draw(broken_bodies(TEMPLATES[route]))
        live.send(figures, *route, json.dumps(body, allow_nan=True).encode(), JSON)

    run()
    finish(figures)


CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-16",
    "application/vnd.x+json",
    "text/plain",
    "multipart/form-data; boundary=x",
    "",
]


def test_raw_bytes_and_truncated_json(live: Live) -> None:
    figures = Figures("raw bytes")

    @fuzz_settings(150)
    @given(data=st.data())
    def run(data: Any) -> None:
        route = data.draw(st.sampled_from(ROUTES))
        template = TEMPLATES.get(route, {"a": [1, 2.5, None]})
        body = data.draw(st.binary(max_size=300) | truncations(template))
        content_type = data.draw(st.sampled_from(CONTENT_TYPES))
        live.send(figures, *route, body, {"content-type": content_type} if content_type else {})

    run()
    finish(figures)


def special_bodies() -> list[bytes]:
    step = json.dumps(TEMPLATES["POST", "/v1/step"]).encode()
    return [
        b"",
        b"null",
        b"   ",
        b"[" * 60_000,  # deep nesting, under the size limit
        b'{"a":' * 12_000 + b"1" + b"}" * 12_000,
        b'{"num_tokens": NaN}',
        b'{"num_tokens": Infinity, "layer": -Infinity}',
        b'{"num_tokens": 1e999}',
        b'{"num_tokens": 1.0}',
        b'{"num_tokens": 1, "num_tokens": 0}',
        b'{"num_tokens": 99999999999999999999999999999999999999}',
        b'{"layer": 0, "seq_ids": ["s0"], "q": {"dtype": "float32", "shape": [1, 4, 16], "data": "\xff\xfe"}}',
        b"\xef\xbb\xbf" + step,  # a UTF-8 byte order mark
        step.decode().encode("utf-16"),
        step[:-1] + b', "extra": "\xc3\x28"}',  # invalid UTF-8
        b'{"seq_ids": ["s0"], "appends": [' + b'{"seq_id": "s3", "num_tokens": 1},' * 2000 + b"{}]}",
        b'{"seq_ids": [' + b'"s0",' * 10_000 + b'"s0"]}',
        b" " * (LIMIT + 1),  # one byte over the limit
    ]


def test_special_bodies_to_every_route(live: Live) -> None:
    figures = Figures("special bodies")
    for body in special_bodies():
        for route in ROUTES:
            live.send(figures, *route, body, JSON)
    # A chunked body (no Content-Length) over the limit, counted as it arrives.
    for route in TEMPLATES:
        live.send(figures, *route, iter([b"{" + b" " * 40_000] * 2), JSON)
    finish(figures)


PATHS = [
    "/v1/sequences/.",
    "/v1/sequences/..",
    "/v1/sequences/%2e",
    "/v1/sequences/%2e%2e",
    "/v1/sequences/%2E%2e/append",
    "/v1/sequences/s0/../s1",
    "/v1/sequences/s0/%2e%2e/s2",
    "/v1/sequences/s0%2f..%2fs1",
    "/v1/sequences/s0%2Fappend",
    "/v1/sequences/s%30",
    "/v1/sequences/s0%00",
    "/v1/sequences/%zz",
    "/v1/sequences/s0;x=1",
    "/v1/sequences/s0/",
    "/v1/sequences//append",
    "/v1/sequences/" + "a" * 129,
    "/v1/sequences/%C3%A9",
    "//v1/pool",
    "/v1//pool",
    "/V1/pool",
    "/v1/pool/",
    "/v1/pool?seq_id=s0&x=%00",
    "/v1/./pool",
    "/./v1/pool",
    "/%76%31/pool",
    "/healthz/../v1/pool",
    "/docs/../v1/ipc",
    "/metrics/../v1/sequences/s0",
    "/v1",
    "/v1/",
    "/v1/sequences",
    "/v1/step/",
    "/v1/attend?layer=0",
    "*",
    "http://127.0.0.1/v1/pool",
]
METHODS = ["GET", "POST", "DELETE", "PUT", "OPTIONS", "HEAD"]


def test_path_tricks_with_and_without_a_key(live: Live) -> None:
    """Raw request targets, exactly as written. With the key, a refusal changes nothing; without it,
    nothing under /v1 (however it is spelt) answers 2xx."""
    figures = Figures("path tricks")
    key = {"Authorization": f"Bearer {KEYS['fuzz']}"}
    for target in PATHS:
        for method in METHODS:
            for headers in (key, {}):
                body = b'{"num_tokens": 0}' if method in ("POST", "PUT", "PATCH") else b""
                answer = raw_request(live.server.port, method, target, {**headers, **JSON}, body)
                what = f"{method} {target} {'with' if headers else 'without'} a key"
                if not headers and answer.status < 300:
                    path = unquote(target.split("?")[0])
                    assert path.startswith(OPEN) or path == "*", f"{what}: {answer.status} {answer.body[:200]!r}"
                if method == "HEAD" and answer.status >= 400:
                    figures.tried += 1  # no body to check
                    figures.refused += 1
                    continue
                live.judge(figures, method, answer.status, answer.body, what)

    @fuzz_settings(60)
    @given(
        seq_id=st.text(max_size=20),
        method=st.sampled_from(["GET", "DELETE", "POST"]),
        tail=st.sampled_from(["", "/append", "/fork"]),
    )
    def run(seq_id: str, method: str, tail: str) -> None:
        if method != "POST":
            tail = ""
        target = f"/v1/sequences/{quote(seq_id, safe='')}{tail}"
        body = b'{"num_tokens": 0}' if tail == "/append" else b'{"seq_id": "."}' if tail else b""
        answer = raw_request(live.server.port, method, target, {**key, **JSON}, body)
        live.judge(figures, method, answer.status, answer.body, f"{method} {target}")

    run()
    finish(figures)
