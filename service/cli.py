"""`kvpool serve` and `kvpool bench ...`."""

import argparse
import gc
import importlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.config import Settings, describe_errors


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for benchmarks and tests that start servers)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting (e.g. --num-pages); unset flags fall back to KVPOOL_* and defaults."""
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        else:
            parser.add_argument(flag, default=None, help=f"{field.description or ''} (KVPOOL_{name.upper()})")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None
    }
    return Settings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvpool: invalid settings\n{describe_errors(exc)}", file=sys.stderr)
        return 2
    import uvicorn

    # kvpool's own loggers (kvpool.*) print beside uvicorn's, at the same level.
    level = logging.DEBUG if args.log_level.lower() == "trace" else args.log_level.upper()  # (uvicorn's "trace")
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")

    from service.server.app import create_app

    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Host-side torch work (the CPU attention reference, page copies) runs on the one device worker
        # thread beside the event loop: intra-op threads only spin against them; on a busy 2-core host
        # attention cost 14x more CPU.
        torch.set_num_threads(1)

    try:
        app = create_app(settings)
    except RuntimeError as exc:
        print(f"kvpool: cannot start: {exc}", file=sys.stderr)
        return 2
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from service.server.connections import ConnectionLimits, connection_cap, guarded_protocol, raise_open_file_limit
    from service.server.shutdown import serve

    fd_limit = raise_open_file_limit()  # a soft limit of 1,024 is common, and each connection holds one
    limits = ConnectionLimits(connection_cap(settings.max_connections, fd_limit), settings.request_head_timeout_s)
    logging.getLogger("kvpool.connections").info(
        "at most %d connections (open-file limit %d)", limits.max_connections, fd_limit
    )
    freeze_startup_heap()
    # No proxy headers: nothing here reads the client's address (there is no access log), and
    # uvicorn's X-Forwarded-For middleware would be one more layer on every request.
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        workers=1,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,
        http=guarded_protocol(limits, AutoHTTPProtocol),  # uvicorn's own (httptools or h11), with limits
        timeout_keep_alive=settings.keep_alive_timeout_s,
        ws="none",  # no WebSocket routes: an upgrade would move the connection out of the guard's sight
    )
    serve(config, app.state.pool, settings.shutdown_grace_s)  # SIGTERM: /readyz 503, drain, exit 0
    return 0


def freeze_startup_heap() -> None:
    """Move what start-up built (torch, FastAPI, pydantic, the pool: ~220k objects) out of the cyclic
    collector's reach, as vLLM does after its engine starts. Left in, they make every oldest-generation
    collection a 50-150 ms stop of the event loop, charged to whichever request tripped it; /metrics,
    which allocates the most objects, tripped it most often."""
    gc.collect()
    gc.freeze()


def _counts(text: str) -> list[int]:
    """`32` or `1,8,32`: positive counts."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count or a comma-separated list of counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be at least 1: {text!r}")
    return counts


def benchmark(name: str) -> Any:
    """benchmarks.<name>, imported on demand: the benchmarks live beside the packages in a checkout
    (an editable install) and are not part of the wheel or the image."""
    try:
        return importlib.import_module(f"benchmarks.{name}")
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", f"benchmarks.{name}"):
            raise
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "benchmarks" / f"{name.replace('.', '/')}.py").is_file():
        raise SystemExit("kvpool bench needs the benchmarks/ folder of a kvpool checkout (pip install -e .)")
    sys.path.insert(0, str(checkout))
    return importlib.import_module(f"benchmarks.{name}")


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """A benchmark's figures as JSON and drawn (benchmarks/report.py, benchmarks/plots.py)."""
    parser.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="also draw them into this image (.png, .svg; needs matplotlib)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description="A standalone paged KV-cache manager.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the pool over HTTP (one worker: the pool lives in the process)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    _add_setting_flags(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    alloc = bench_sub.add_parser("alloc", help="allocator throughput and step latency (in process and HTTP)")
    alloc.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    alloc.add_argument("--peers", action="store_true", help="side by side with vLLM's KVCacheManager (needs vllm)")
    _add_output_flags(alloc)
    alloc.set_defaults(func=lambda a: benchmark("alloc").main(a))
    http = bench_sub.add_parser("http", help="concurrent clients against one server: requests/s, latency, leaks")
    http.add_argument("--url", help="target this server instead of starting one (e.g. http://127.0.0.1:8000)")
    http.add_argument(
        "--clients", type=_counts, default=[32], help="concurrent clients; a list (1,8,32) runs each in turn"
    )
    http.add_argument("--seconds", type=float, default=20.0, help="how long the clients run (after the warm-up)")
    http.add_argument("--warmup", type=float, default=2.0, help="seconds of requests not counted in the figures")
    http.add_argument("--max-requests", type=int, default=1_000_000, help="stop early after this many requests")
    http.add_argument("--num-pages", type=int, default=1024, help="pool size of the server this command starts")
    http.add_argument("--seed", type=int, default=0)
    http.add_argument("--client", choices=["raw", "httpx"], default="raw", help="raw: keep-alive HTTP/1.1 on asyncio")
    _add_output_flags(http)
    http.set_defaults(func=lambda a: benchmark("http").main(a))
    tiers = bench_sub.add_parser("tiers", help="restores from host, disk and remote tiers; hit rate with them")
    tiers.add_argument("--layers", type=int, default=8)
    tiers.add_argument("--kv-heads", type=int, default=4)
    tiers.add_argument("--head-dim", type=int, default=64)
    tiers.add_argument("--page-size", type=int, default=16)
    tiers.add_argument("--prefix", type=int, default=4096, help="tokens of each prefix")
    tiers.add_argument("--prefixes", type=int, default=8, help="prefixes in the working set")
    tiers.add_argument("--device-prefixes", type=int, default=2, help="prefixes the device pool holds")
    tiers.add_argument("--repeat", type=int, default=9, help="restores timed per tier")
    tiers.add_argument("--requests", type=int, default=48, help="requests of the hit-rate workload (0: skip it)")
    tiers.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, 512-token prefixes")
    tiers.add_argument(
        "--tiers",
        default="host,disk,remote,remote-mac",
        help="which to time, comma-separated: host, disk, remote, remote-mac (its entries sealed by a keyed MAC: "
        "KVPOOL_REMOTE_SECRET), remote-redispy (its reads through redis-py), "
        "remote-cluster (a 3-node Redis Cluster on loopback)",
    )
    _add_output_flags(tiers)
    tiers.set_defaults(func=lambda a: benchmark("tiers").main(a))

    match = bench_sub.add_parser("match", help="POST /v1/prefix/match: p50 in process and over HTTP")
    match.add_argument("--tokens", type=int, default=4096, help="prompt length")
    match.add_argument("--page-size", type=int, default=16)
    match.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    match.add_argument(
        "--spill", choices=["none", "host", "disk"], default="none", help="also time a prompt held by this tier"
    )
    match.set_defaults(func=lambda a: benchmark("match").main(a))
    # Its options are its own (benchmarks/serving/run.py): everything after `bench serving` goes to it.
    bench_sub.add_parser("serving", help="vLLM replicas with and without kvpool under real clients (--quick: CI)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serving"]:
        code: int = benchmark("serving.run").main(argv[2:])
        return code
    args = parser.parse_args(argv)
    args.argv = ["kvpool", *argv]  # the command a benchmark's JSON names
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
