"""Request bodies parsed by the endpoints themselves (service/server/bodies.py): every bad body gets the
one 422 envelope and changes nothing; 405 answers name every documented method of the path.

Against a real `kvpool serve`: valid requests, then every kind of bad body (not JSON, NaN, not an
object, wrong Content-Type, empty, invalid for the model), each answered with the same status, code
and message it had when FastAPI parsed the bodies itself, except for the wording of JSON syntax errors
and Content-Type (pydantic's parser now reads the bytes), checked here by their message prefix.
"""

import asyncio
from typing import Any

import orjson
import pytest
import torch

from service.config import Settings
from service.server.app import create_app
from tests.conftest import Server, enc

JSON = {"content-type": "application/json"}


def kv(num_tokens: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, num_tokens, 2, 16, generator=gen) for _ in range(2))
    return {"k": enc(k), "v": enc(v)}


def q(num_tokens: int) -> dict[str, Any]:
    return enc(torch.randn(num_tokens, 4, 16, generator=torch.Generator().manual_seed(5)))


# (method, path, raw body, headers, status, error code, the message or its start)
BAD_BODIES: list[tuple[str, str, bytes, dict[str, str], int, str, str]] = [
    ("POST", "/v1/sequences", b'{"seq_id": "e", "extra": 1}', JSON, 422, "invalid_request", "extra: Extra inputs"),
    ("POST", "/v1/sequences", b'{"ttl_s": "3"}', JSON, 422, "invalid_request", "ttl_s: Input should be a valid number"),
    ("POST", "/v1/sequences", b'["not", "an", "object"]', JSON, 422, "invalid_request", "Input should be an object"),
    ("POST", "/v1/sequences/a/append", b'{"num_tokens": 0}', JSON, 422, "invalid_request", "num_tokens: Input should"),
    (
        "POST",
        "/v1/sequences/a/append",
        b'{"num_tokens": 2, "token_ids": [1]}',
        JSON,
        422,
        "invalid_request",
        "Value error, token_ids has 1 ids, num_tokens is 2",
    ),
    (
        "POST",
        "/v1/step",
        b'{"appends": [{"seq_id": "bad id", "num_tokens": 1}]}',
        JSON,
        422,
        "invalid_request",
        "appends.0.seq_id: String should match pattern",
    ),
    ("POST", "/v1/sequences", b'{"seq_id": "e",', JSON, 422, "invalid_request", "the body is not valid JSON ("),
    ("POST", "/v1/sequences", b"\xff\xfe", JSON, 422, "invalid_request", "the body is not valid JSON ("),
    ("POST", "/v1/sequences", b'{"ttl_s": NaN}', JSON, 422, "invalid_request", "ttl_s: Input should be a finite"),
    (
        "POST",
        "/v1/attend",
        b'{"layer": 0, "seq_ids": ["a"], "q": %s, "scale": Infinity}' % orjson.dumps(q(1)),
        JSON,
        422,
        "invalid_request",
        "scale: Input should be a finite number",
    ),
    ("POST", "/v1/sequences", b"", JSON, 422, "invalid_request", "Field required"),
    ("POST", "/v1/sequences", b"null", JSON, 422, "invalid_request", "Input should be an object"),
    ("POST", "/v1/sequences", b'{"seq_id": "e"}', {}, 422, "invalid_request", "the body must be sent as Content-Type"),
    (
        "POST",
        "/v1/sequences/a/fork",
        b'{"seq_id": "f"}',
        {"content-type": "text/plain"},
        422,
        "invalid_request",
        "the body must be sent as Content-Type: application/json",
    ),
    (
        "POST",
        f"/v1/sequences/{'x' * 129}/append",
        b'{"num_tokens": 1}',
        JSON,
        422,
        "invalid_request",
        "path.seq_id: String should match pattern",
    ),
    ("POST", "/v1/sequences", b'{"seq_id": "a"}', JSON, 409, "sequence_exists", "sequence 'a' already exists"),
    ("POST", "/v1/sequences/nope/append", b'{"num_tokens": 1}', JSON, 404, "sequence_not_found", "sequence 'nope'"),
    ("POST", "/v1/sequences/a/append", b'{"num_tokens": 10000}', JSON, 507, "out_of_pages", "need 2500 pages"),
]


def test_bad_bodies_get_the_envelope_and_change_nothing(start_server: Any) -> None:
    server: Server = start_server()  # the small pool: 2 layers, 2 KV heads of 16, 16 pages of 4 tokens
    c = server.client
    assert c.post("/v1/sequences", json={"seq_id": "a", "token_ids": list(range(9))}).status_code == 201
    assert c.post("/v1/sequences/a/append", json={"num_tokens": 3, **kv(3, 1)}).status_code == 200
    # Bodies that are JSON by another name, or optional and absent, are fine.
    r = c.post("/v1/sequences", content=b'{"seq_id": "b"}', headers={"content-type": "application/vnd.x+json"})
    assert r.status_code == 201
    r = c.post("/v1/sequences/b/fork", content=b'{"seq_id": "c"}', headers={"content-type": "Application/JSON; x=1"})
    assert r.status_code == 201 and r.json()["seq_id"] == "c"
    r = c.post("/v1/sequences/c/fork")  # no body: a generated id
    assert r.status_code == 201 and len(r.json()["seq_id"]) == 32
    r = c.post("/v1/sequences/c/fork", content=b" null", headers=JSON)  # the schema's `ForkSequence | null`
    assert r.status_code == 201 and len(r.json()["seq_id"]) == 32
    before = c.get("/v1/pool").json(), c.get("/v1/sequences/a").json()
    out = c.post("/v1/attend", json={"layer": 1, "seq_ids": ["a"], "q": q(1)}).json()["out"]
    for method, path, body, headers, status, code, message in BAD_BODIES:
        r = c.request(method, path, content=body, headers=headers)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(r.json()) == {"error"} and set(error) <= {"code", "message", "details"}, r.text
        assert error["code"] == code and error["message"].startswith(message), (body, r.text)
    assert (c.get("/v1/pool").json(), c.get("/v1/sequences/a").json()) == before
    assert c.post("/v1/attend", json={"layer": 1, "seq_ids": ["a"], "q": q(1)}).json()["out"] == out


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PATCH", "/v1/sequences/a", "DELETE, GET"),  # two routes share the path
        ("PUT", "/v1/step", "POST"),
        ("GET", "/v1/sequences/a/append", "POST"),
        ("DELETE", "/v1/pool", "GET"),
        ("POST", "/healthz", "GET"),
    ],
)
def test_405_names_every_documented_method(server: Server, method: str, path: str, allow: str) -> None:
    r = server.client.request(method, path)
    assert (r.status_code, r.json()["error"]["code"], r.headers["allow"]) == (405, "method_not_allowed", allow)


def call(app: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST /v1/sequences straight into the ASGI app, its body in `messages`; what the app sent."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/sequences",
        "raw_path": b"/v1/sequences",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"kvpool"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "state": {},
    }
    pending, sent = list(messages), []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def test_bodies_in_chunks_and_clients_gone_mid_body() -> None:
    """A body in several ASGI messages is read whole; a client gone mid-body gets a 422, not a 500."""
    app = create_app(Settings(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cpu"))
    body = orjson.dumps({"seq_id": "chunked", "token_ids": [1, 2, 3, 4, 5]})
    chunks = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.request", "body": body[10:], "more_body": False},
    ]
    sent = call(app, chunks)
    assert sent[0]["status"] == 201 and orjson.loads(sent[1]["body"])["seq_id"] == "chunked"
    gone = call(app, [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}])
    assert gone[0]["status"] == 422 and orjson.loads(gone[1]["body"])["error"]["code"] == "invalid_request"
    assert [s.seq_id for s in app.state.pool.sequences.sequences()] == ["chunked"]
