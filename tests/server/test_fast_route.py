"""The fast path (service/fast_route.py) and RouteDispatch (service/dispatch.py) answer exactly as FastAPI does.

Two apps with the same settings get the same requests: one as built, one with the fast path forced
off (any entry in `app.dependency_overrides` sends every request to FastAPI's handler). Every answer
must match byte for byte (status, headers, body), valid or not, and so must the pools afterwards.
The requests that reach FastAPI's handler are counted to prove which path each request took, so the comparison
cannot pass by both apps taking the same one, and so are the requests the router selects itself.
"""

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

import service.server.routing
from service.config import Settings
from service.server.app import create_app
from service.server.dispatch import RouteDispatch
from service.server.fast_route import FastPath
from service.server.routing import ORJSONRoute
from tests.conftest import enc
from tests.server.test_async_handlers import api_routes

SETTINGS = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=16, device="cpu")
JSON = {"content-type": "application/json"}
ROUTER_ANSWERS = [
    ("PUT", "/v1/step"),
    ("GET", "/v1/step"),
    ("PATCH", "/v1/sequences/a"),
    ("GET", "/v1/nothing"),
    ("GET", "/v1/pool/"),
    ("HEAD", "/healthz"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
]
HOT_ROUTES = {
    ("POST", "/v1/sequences"),
    ("GET", "/v1/sequences/{seq_id}"),
    ("POST", "/v1/sequences/{seq_id}/append"),
    ("POST", "/v1/sequences/{seq_id}/fork"),
    ("DELETE", "/v1/sequences/{seq_id}"),
    ("POST", "/v1/step"),
    ("POST", "/v1/attend"),
    ("GET", "/v1/pool"),
}


def kv(num_tokens: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, num_tokens, 2, 16, generator=gen) for _ in range(2))
    return {"num_tokens": num_tokens, "k": enc(k), "v": enc(v)}


def q(num_tokens: int, seed: int) -> dict[str, Any]:
    return enc(torch.randn(num_tokens, 4, 16, generator=torch.Generator().manual_seed(seed)))


# (method, path, raw body or None, headers, took the fast path): valid requests, then every kind of bad input.
def requests() -> Iterator[tuple[str, str, bytes | None, dict[str, str], bool]]:
    import orjson

    def post(path: str, body: Any, fast: bool = True, headers: dict[str, str] = JSON) -> Any:
        return ("POST", path, orjson.dumps(body), headers, fast)

    yield post("/v1/sequences", {"seq_id": "a", "token_ids": list(range(9))})
    yield post("/v1/sequences", {"seq_id": "b"})
    yield post("/v1/sequences/a/append", {**kv(3, 1), "token_ids": [7, 8, 9]})
    yield post("/v1/sequences/b/append", kv(5, 2))
    yield post("/v1/sequences/a/fork", {"seq_id": "a2"})
    yield ("POST", "/v1/sequences/a2/fork", None, {}, False)  # no body: FastAPI's path (fork's body is optional)
    yield post("/v1/step", {"appends": [{"seq_id": "a", "num_tokens": 1}, {"seq_id": "b", "num_tokens": 2}]})
    yield post("/v1/step", {"appends": [{"seq_id": "a2", "num_tokens": 1}], "format": "flashinfer"})
    yield post("/v1/attend", {"layer": 1, "seq_ids": ["a", "b"], "q": q(2, 3)})
    yield post("/v1/attend", {"layer": 0, "seq_ids": ["a", "b"], "q": q(3, 4), "q_lens": [1, 2], "softcap": 3.0})
    yield ("GET", "/v1/sequences/a", None, {}, True)
    yield ("GET", "/v1/pool", None, {}, True)
    yield post("/v1/sequences", {"seq_id": "c"}, headers={"content-type": "APPLICATION/JSON"})
    yield post("/v1/sequences", {"seq_id": "d"}, False, {"content-type": "application/json; charset=utf-8"})
    # Errors the core raises after validation: the same 404/409/507 envelope on both paths.
    yield post("/v1/sequences", {"seq_id": "a"})  # exists: 409
    yield post("/v1/sequences/nope/append", {"num_tokens": 1})  # 404
    yield post("/v1/sequences/a/append", {"num_tokens": 10_000})  # out of pages: 507
    yield post("/v1/step", {"appends": [{"seq_id": "a", "num_tokens": 2, "token_ids": [1]}]})  # 422 from the core
    yield post("/v1/attend", {"layer": 5, "seq_ids": ["a"], "q": q(1, 5)})  # 422 from the route
    yield post("/v1/sequences/a/append", {"num_tokens": 1, "k": kv(2, 6)["k"], "v": kv(2, 6)["v"]})  # wrong shape
    # Bad input FastAPI itself rejects: the fast path hands each of these to FastAPI's handler.
    yield post("/v1/sequences", {"seq_id": "e", "extra": 1}, False)
    yield post("/v1/sequences", {"seq_id": "e", "ttl_s": "3"}, False)  # strict: no coercion
    yield post("/v1/sequences", ["not", "an", "object"], False)
    yield post("/v1/sequences/a/append", {"num_tokens": 0}, False)
    yield post("/v1/sequences/a/append", {"num_tokens": 2, "token_ids": [1]}, False)  # the model's validator
    yield post("/v1/step", {"appends": [{"seq_id": "bad id", "num_tokens": 1}]}, False)
    yield post("/v1/attend", {"layer": 0, "seq_ids": ["a"], "q": q(1, 5), "v": kv(1, 6)["v"]}, False)
    yield ("POST", "/v1/sequences", b'{"seq_id": "e",', JSON, False)  # not JSON
    yield ("POST", "/v1/sequences", b'{"scale": NaN}', JSON, False)
    yield ("POST", "/v1/attend", b'{"layer": 0, "seq_ids": ["a"], "q": 1, "scale": Infinity}', JSON, False)
    yield ("POST", "/v1/sequences", b"\xff\xfe", JSON, False)  # not UTF-8
    yield ("POST", "/v1/sequences", b'{"seq_id": "e"}', {"content-type": "text/plain"}, False)
    yield ("POST", "/v1/sequences", b'{"seq_id": "e"}', {}, False)  # no content type
    yield ("POST", "/v1/sequences", b"", JSON, False)  # empty body
    yield ("POST", "/v1/sequences/a/fork", b'{"seq_id": "f"}', {"content-type": "text/plain"}, False)
    yield ("POST", f"/v1/sequences/{'x' * 129}/append", b'{"num_tokens": 1}', JSON, False)  # path pattern
    yield ("DELETE", "/v1/sequences/a%0A", None, {}, False)  # a newline: the pattern's $ must not match it
    yield ("GET", "/v1/sequences/a b", None, {}, False)
    # What the router itself answers (RouteDispatch hands these over): 405, 404, the trailing-slash
    # redirect, HEAD on a GET route, the docs.
    for method, path in ROUTER_ANSWERS:
        yield (method, path, None, {}, False)
    # Valid again, then the frees: the pools must end the same.
    yield ("DELETE", "/v1/sequences/a2", None, {}, True)
    yield ("DELETE", "/v1/sequences/b", None, {}, True)
    yield ("GET", "/v1/pool", None, {}, True)


def build_apps() -> tuple[FastAPI, FastAPI]:
    fast, slow = create_app(Settings(**SETTINGS)), create_app(Settings(**SETTINGS))  # type: ignore[arg-type]
    slow.dependency_overrides[object] = object  # any override: every request takes FastAPI's path
    return fast, slow


def without_instance_id(body: bytes) -> bytes:
    import orjson

    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if isinstance(data, dict):
        data.pop("instance_id", None)  # random per app
        if len(data.get("seq_id", "")) == 32:  # generated (a fork without a body): random per app
            data["seq_id"] = "<generated>"
    return orjson.dumps(data)


def test_every_answer_matches_fastapis_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    solved = []  # one entry per request that reached FastAPI's handler (which builds one ORJSONRequest)

    class CountingRequest(service.server.routing.ORJSONRequest):
        def __init__(self, *args: Any) -> None:
            solved.append(1)
            super().__init__(*args)

    monkeypatch.setattr(service.server.routing, "ORJSONRequest", CountingRequest)
    fast_app, slow_app = build_apps()
    dispatch = fast_app.router.middleware_stack
    assert isinstance(dispatch, RouteDispatch)
    routed = []  # one entry per request the fast app's router selected itself
    router_app = dispatch.router_app

    async def counting_router(scope: Any, receive: Any, send: Any) -> None:
        routed.append(1)
        await router_app(scope, receive, send)

    dispatch.router_app = counting_router

    async def run() -> None:
        fast = httpx.AsyncClient(transport=httpx.ASGITransport(app=fast_app), base_url="http://kvpool")
        slow = httpx.AsyncClient(transport=httpx.ASGITransport(app=slow_app), base_url="http://kvpool")
        async with fast, slow:
            for method, path, body, headers, takes_fast_path in requests():
                solved.clear()
                routed.clear()
                a = await fast.request(method, path, content=body, headers=headers)
                fast_solves = len(solved)
                assert len(routed) == ((method, path) in ROUTER_ANSWERS), f"{method} {path}"
                b = await slow.request(method, path, content=body, headers=headers)
                where = f"{method} {path} {body!r:.80}"
                handled = (method, path) not in ROUTER_ANSWERS  # by an API route's handler
                assert len(solved) - fast_solves == handled, where  # the forced app: always FastAPI's handler
                assert fast_solves == (handled and not takes_fast_path), where
                assert (a.status_code, without_instance_id(a.content)) == (
                    b.status_code,
                    without_instance_id(b.content),
                ), where
                assert a.headers.raw == b.headers.raw, where
                if a.status_code >= 400 and method != "HEAD":  # a HEAD answer has no body
                    assert set(a.json()) == {"error"} and set(a.json()["error"]) == {"code", "message"}, where

    asyncio.run(run())
    fast_pool, slow_pool = fast_app.state.pool, slow_app.state.pool
    tables = [sorted(p.sequences.block_table(s) for s in p.sequences.sequences()) for p in (fast_pool, slow_pool)]
    assert {s.seq_id for s in fast_pool.sequences.sequences()} >= {"a", "c", "d"} and tables[0] == tables[1]
    assert fast_pool.allocator.num_used == slow_pool.allocator.num_used
    torch.testing.assert_close(fast_pool.storage.blocks, slow_pool.storage.blocks, atol=0, rtol=0)


def test_the_hot_routes_have_a_fast_path() -> None:
    app = create_app(Settings(**SETTINGS))  # type: ignore[arg-type]
    routes = {(m, r.path): r for r in api_routes(app.router.routes) for m in r.methods}
    assert HOT_ROUTES <= set(routes)
    for key in HOT_ROUTES:
        assert FastPath.of(routes[key]) is not None, key


def test_the_dispatch_skips_a_route_only_where_its_matches_finds_nothing() -> None:
    """The path regex each table entry keeps rejects exactly the paths its route's `matches` answers
    Match.NONE for, and every API route has one (so the scan skips without calling `matches`)."""
    from starlette._utils import get_route_path
    from starlette.routing import Match

    app = create_app(Settings(**SETTINGS))  # type: ignore[arg-type]
    dispatch = app.router.middleware_stack
    assert isinstance(dispatch, RouteDispatch)
    table = dispatch.table()
    api = [(regex, context) for regex, context, _ in table if context is not None and context.app is not None]
    assert len(api) >= len(HOT_ROUTES) and all(regex is not None for regex, _ in api)
    paths = {path for _, path in ROUTER_ANSWERS} | {p.replace("{seq_id}", "a") for _, p in HOT_ROUTES}
    paths |= {"/v1/sequences/a/b/append", "/v1/sequences//append", "/v1/attendx", "/"}
    for regex, context, owner in table:
        if regex is None:
            continue
        for path, root_path in itertools.product(sorted(paths), ("", "/api")):  # also mounted under /api
            for method in ("GET", "POST", "DELETE"):
                scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path}
                scope["path_params"] = {}
                found = (context or owner).matches(scope)[0]
                skipped = regex.match(get_route_path(scope)) is None  # what the dispatch tests
                assert skipped == (found == Match.NONE), (root_path, path, method, regex.pattern)


def test_routes_the_fast_path_does_not_handle_keep_fastapis_handler() -> None:
    async def with_query(n: int) -> Response:
        """A query parameter."""
        return Response()

    async def returns_dict() -> dict[str, int]:
        """The result goes through the response model."""
        return {}

    def sync_endpoint() -> Response:
        """Runs in the thread pool."""
        return Response()

    async def sync_dependency_user(x: Any = Depends(lambda: 1)) -> Response:  # noqa: B008
        """A plain `def` dependency."""
        return Response()

    async def request_only(request: Request) -> Response:
        """Only the request."""
        return Response()

    for endpoint in (with_query, returns_dict, sync_endpoint, sync_dependency_user):
        assert FastPath.of(APIRoute("/x", endpoint)) is None, endpoint.__name__
    assert FastPath.of(ORJSONRoute("/x", request_only)) is not None


def test_bodies_in_chunks_and_clients_gone_mid_body_are_answered_alike() -> None:
    """A body in several ASGI messages takes the fast path; a disconnect mid-body gets FastAPI's answer."""
    import orjson

    body = orjson.dumps({"seq_id": "chunked", "token_ids": [1, 2, 3, 4, 5]})

    async def call(app: FastAPI, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
        pending = list(messages)
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return pending.pop(0) if pending else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return sent

    async def run() -> None:
        fast_app, slow_app = build_apps()
        chunks = [
            {"type": "http.request", "body": body[:10], "more_body": True},
            {"type": "http.request", "body": body[10:], "more_body": False},
        ]
        gone = [{"type": "http.request", "body": body[:10], "more_body": True}, {"type": "http.disconnect"}]
        for messages in (chunks, gone):
            a, b = await call(fast_app, list(messages)), await call(slow_app, list(messages))
            assert a == b
        assert a[0]["status"] == 422  # FastAPI's 400 for a body it could not read, as the envelope maps it
        assert fast_app.state.pool.sequences.get("chunked").seq_id == "chunked"

    asyncio.run(run())
