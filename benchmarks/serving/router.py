"""A small routing proxy in front of the fleet's vLLM servers: the clients talk to it as to one server.

    python -m benchmarks.serving.router --port P --backends URL[,URL] --policy rr|match|dynamo --log FILE
        [--kvpools URL,URL] [--indexer URL]

Policies (every configuration goes through one, one backend or two, so that each pays the same hop):
- `rr`: round robin.
- `match`: ask each node's kvpool `POST /v1/prefix/match` how many leading tokens of the prompt it holds
  (`--kvpools`, in the order of `--backends`) and send the request to the node that holds the most.
- `dynamo`: ask Dynamo's standalone KV indexer (`--indexer`; `POST /query`, the nodes registered as
  instances 0, 1, ... in the order of `--backends`) which node holds the longest prefix.
Both prefix policies weigh the match against the load, as Dynamo's KV router does (its cost: the blocks a
node would prefill, its requests still prefilling included, plus the blocks of the requests it is serving):
a node's cost is the prompt tokens it would compute, plus the tokens its requests not yet at their first
token are computing (as estimated when each was routed; a request leaves them at its first streamed byte,
as Dynamo's router marks a prefill complete at the first token), plus the prompt tokens of the requests it
has in flight (the KV they hold while they decode), and the cheapest node gets the request (ties: round
robin). By the match alone, a prefix every
prompt shares (a system prompt) would draw every request to the first node that held it. With
`--shared-tier` (the nodes share a remote tier, into which each kvpool writes every page it computed), a
node also holds what any node holds, behind a restore: those tokens are not computed but restored, each
counted as `--restore-weight` of a computed one. Without it, the node a conversation last ran on would
hold its history alone and draw every later round of it, however busy.

The prompt's token ids come from the model's own tokenizer in this process (`--model`: its chat template
rendered as vLLM renders it), as Dynamo's frontend tokenizes before its KV router: a round trip to a busy
engine's `POST /tokenize` cost a routed request tens of milliseconds. The first requests are also tokenized
by the first backend's `POST /tokenize` (vLLM renders and tokenizes exactly as it will serve), beside the
request; if the two ever differ, or without `--model`, the router asks the backend for every request after.

Every proxied completion is logged (one JSON line: path, body, backend, status, error), which is
how the benchmark counts failed requests and samples requests to replay; with, from this process's clock,
its time choosing the node (`route_s`) and to its first byte (`first_byte_s`), and the nodes' loads as the
prefix policies weigh them when it was routed (`compute`, `prefilling`, `active`; zeros under round robin,
which weighs none), from which benchmarks.serving.holders classes each request.
"""

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.http_client import RawTransport, TransportError
from benchmarks.serving.fleet import MODEL_NAME

LOGGED_PATHS = {"v1/completions", "v1/chat/completions"}
JSON_BODY = {"content-type": "application/json"}
CHECKED = 8  # requests tokenized both here and by the backend, which must agree
# A token restored from the shared tier against one computed: on the fleet's machine a create restoring a
# ~1,000-token history from Redis took 20-35 ms under load, a prefill 0.3-0.5 ms per token (docs/fleet.md).
RESTORE_WEIGHT = 0.1


def computed(prompt_len: int, held: list[int], shared_tier: bool, restore_weight: float) -> list[float]:
    """The tokens each node would compute for a prompt of `prompt_len` tokens: the prompt less what it holds,
    `held`; with a shared tier, less what any node holds, the part beyond its own restored at `restore_weight`."""
    held = [min(h, prompt_len) for h in held]
    anywhere = max(held, default=0) if shared_tier else 0
    return [prompt_len - max(h, anywhere) + restore_weight * max(0, anywhere - h) for h in held]


def costs(compute: list[float], prefilling: list[float], active: list[int]) -> list[float]:
    """Each node's cost for a prompt: `compute`, the tokens it would compute (`computed`), plus `prefilling`, the
    tokens its requests not yet at their first token compute, plus `active`, the prompt tokens of its requests in
    flight."""
    return [c + p + a for c, p, a in zip(compute, prefilling, active)]


class IndexClient:
    """The index's queries (`POST /v1/prefix/match`, `POST /query`: a prompt's token ids one way, a few numbers
    back) over kept-alive raw HTTP/1.1 connections (benchmarks.http_client.RawTransport, one request at a
    time each; one per query in flight, kept for the next): httpx's client costs ~10x their CPU per call
    (docs/benchmarks.md, "Figures behind the code"), and choosing a node is on every routed request's path."""

    def __init__(self) -> None:
        self.idle: dict[str, list[RawTransport]] = {}

    async def post(self, url: str, path: str, body: object) -> tuple[int, bytes]:
        """(status, body) of the query; raises TransportError where a fresh connection fails."""
        idle = self.idle.setdefault(url, [])
        while True:
            reused = bool(idle)
            conn = idle.pop() if reused else RawTransport(url)
            try:
                answer = await conn.send("POST", path, body)
            except TransportError:
                await conn.close()
                if reused:  # a kept-alive connection the server has closed meanwhile (uvicorn: after 5 s idle)
                    continue  # (the queries change nothing: sent again on another)
                raise
            except BaseException:  # (its stream in an unknown state: never reused)
                await conn.close()
                raise
            idle.append(conn)
            return answer


class Router:
    def __init__(self, args: argparse.Namespace) -> None:
        self.backends: list[str] = args.backends.split(",")
        self.kvpools: list[str] = args.kvpools.split(",") if args.kvpools else []
        self.indexer: str = args.indexer
        self.policy: str = args.policy
        self.shared_tier: bool = args.shared_tier
        self.restore_weight: float = args.restore_weight
        self.in_flight = [0] * len(self.backends)
        self.active = [0] * len(self.backends)  # prompt tokens of the requests in flight
        self.prefilling = [0.0] * len(self.backends)  # tokens computed by the requests before their first byte
        self.turn = itertools.cycle(range(len(self.backends)))
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=512)
        )
        self.index = IndexClient()
        self.log = open(args.log, "a", buffering=1)
        self.routed = [0] * len(self.backends)
        self.route_ns = 0  # time spent choosing (tokenize + match/query), over all requests (`chosen` by a policy)
        self.chosen = 0  # requests routed by a prefix policy
        self.tokenizer: Any = None
        if args.model:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.checked = 0  # requests whose local token ids the backend's agreed with
        self.mismatches = 0
        self.checks: set[asyncio.Task[None]] = set()

    def local_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path == "v1/chat/completions":
            rendered = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(body["prompt"])["input_ids"])

    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if isinstance(body.get("prompt"), list):
            return list(body["prompt"])
        if self.tokenizer is None or self.mismatches:
            return await self.backend_ids(path, body)
        ids = self.local_ids(path, body)
        if self.checked + len(self.checks) < CHECKED:  # checked beside the request, not before it
            task = asyncio.create_task(self.check(path, body, ids))
            self.checks.add(task)
            task.add_done_callback(self.checks.discard)
        return ids

    async def check(self, path: str, body: dict[str, Any], ids: list[int]) -> None:
        if ids == await self.backend_ids(path, body):
            self.checked += 1
        else:
            self.mismatches += 1  # from now on the backend tokenizes

    async def backend_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        ask: dict[str, Any] = {"model": body.get("model", MODEL_NAME)}
        if path == "v1/chat/completions":
            ask["messages"] = body["messages"]
        elif isinstance(body.get("prompt"), list):
            return list(body["prompt"])
        else:
            ask["prompt"] = body["prompt"]
        answer = await self.client.post(f"{self.backends[0]}/tokenize", json=ask)
        answer.raise_for_status()
        return list(answer.json()["tokens"])

    async def matched(self, token_ids: list[int]) -> list[int]:
        """Tokens of the prompt each node holds, by the policy's source."""
        if self.policy == "match":
            ask = {"token_ids": token_ids}
            answers = await asyncio.gather(*(self.index.post(url, "/v1/prefix/match", ask) for url in self.kvpools))
            return [orjson.loads(body)["cached_tokens"] if status == 200 else 0 for status, body in answers]
        status, body = await self.index.post(self.indexer, "/query", {"token_ids": token_ids, "model_name": MODEL_NAME})
        instances = orjson.loads(body).get("instances", {}) if status == 200 else {}
        return [int(instances.get(str(i), {}).get("longest_matched", 0)) for i in range(len(self.backends))]

    async def choose(self, path: str, body: dict[str, Any]) -> tuple[int, int, float]:
        """The backend for a request, the prompt's length in tokens (its load there while in flight) and the
        tokens it is expected to compute there (its load there until its first byte)."""
        if self.policy == "rr" or len(self.backends) == 1:
            return next(self.turn), 0, 0.0
        token_ids = await self.token_ids(path, body)
        scores = await self.matched(token_ids)
        self.chosen += 1
        compute = computed(len(token_ids), scores, self.shared_tier, self.restore_weight)
        cost = costs(compute, self.prefilling, self.active)
        cheapest = [i for i, c in enumerate(cost) if c == min(cost)]
        index = cheapest[0] if len(cheapest) == 1 else next(i for i in self.turn if i in cheapest)
        return index, len(token_ids), compute[index]

    async def proxy(self, request: Request) -> Response:
        path = request.path_params["path"]
        raw = await request.body()
        if path not in LOGGED_PATHS:  # /v1/models, /tokenize, ...: the first backend answers
            answer = await self.client.request(
                request.method, f"{self.backends[0]}/{path}", content=raw, headers=JSON_BODY if raw else None
            )
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        body = json.loads(raw)
        arrived = time.perf_counter()  # (not the loop's clock: uvloop's counts whole milliseconds)
        index, load, compute = await self.choose(path, body)
        routed_s = time.perf_counter() - arrived
        self.route_ns += int(routed_s * 1e9)  # (round robin adds microseconds, and chooses none: `chosen`)
        self.in_flight[index] += 1
        self.active[index] += load
        self.prefilling[index] += compute
        self.routed[index] += 1
        # (the nodes' loads as they were when it was routed, this request's own included; round robin keeps none)
        record: dict[str, Any] = {
            "path": path, "body": body, "backend": index, "route_s": routed_s, "compute": compute,
            "prefilling": list(self.prefilling), "active": list(self.active),
        }  # fmt: skip
        prefilled = False

        def prefill_done() -> None:  # (once: at the first byte, or when the request ends without one)
            nonlocal prefilled
            if not prefilled:
                prefilled = True
                self.prefilling[index] -= compute
                record["first_byte_s"] = time.perf_counter() - arrived

        upstream = self.client.build_request("POST", f"{self.backends[index]}/{path}", content=raw, headers=JSON_BODY)
        try:
            answer = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            prefill_done()
            self.in_flight[index] -= 1
            self.active[index] -= load
            self.write(record | {"status": 0, "error": repr(error)})
            return JSONResponse({"error": {"code": "bad_gateway", "message": repr(error)}}, 502)

        async def relay() -> AsyncIterator[bytes]:
            error = ""
            try:
                async for chunk in answer.aiter_raw():
                    prefill_done()  # vLLM streams its first chunk with the first token
                    yield chunk
            except httpx.HTTPError as failure:
                error = repr(failure)
            finally:
                prefill_done()
                await answer.aclose()
                self.in_flight[index] -= 1
                self.active[index] -= load
                self.write(record | {"status": answer.status_code, "error": error})

        return StreamingResponse(relay(), answer.status_code, media_type=answer.headers.get("content-type"))

    def write(self, record: dict[str, Any]) -> None:
        self.log.write(json.dumps(record) + "\n")

    async def stats(self, request: Request) -> Response:
        return JSONResponse(
            {
                "routed": self.routed, "in_flight": self.in_flight, "prefilling": self.prefilling,
                "route_ns": self.route_ns, "chosen": self.chosen,
                "tokenized_here": self.tokenizer is not None and not self.mismatches, "checked": self.checked,
                "mismatches": self.mismatches,
            }
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backends", required=True)
    parser.add_argument("--policy", choices=["rr", "match", "dynamo"], default="rr")
    parser.add_argument("--kvpools", default="")
    parser.add_argument("--indexer", default="")
    parser.add_argument("--shared-tier", action="store_true", help="the nodes' kvpools share a remote tier")
    parser.add_argument("--restore-weight", type=float, default=RESTORE_WEIGHT)
    parser.add_argument("--model", default="", help="the model's directory: its tokenizer tokenizes here")
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    router = Router(args)

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/router/health", health),
            Route("/router/stats", router.stats),
            Route("/{path:path}", router.proxy, methods=["GET", "POST"]),
        ]
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
