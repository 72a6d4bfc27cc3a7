"""A prefill/decode proxy for two vLLM OpenAI servers sharing one kvpool (a test and benchmark tool, not product).

    python -m benchmarks.pd_proxy --producer http://127.0.0.1:8001 --consumer http://127.0.0.1:8002 --port 8000

Each POST /v1/completions goes to the producer (kv_role kv_producer) with max_tokens=1, which computes the
prompt and saves it to kvpool; then, with the kv_transfer_params of the producer's answer, to the consumer
(kv_role kv_consumer), which loads the prompt from kvpool and decodes. That is what vLLM's
disaggregated-serving proxies do; the kv_transfer_params make the consumer wait for the producer's saves.
"""

import argparse
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI


def complete(client: httpx.Client, producer: str, consumer: str, body: dict[str, Any]) -> dict[str, Any]:
    """One completion through both engines; the consumer's answer."""
    prefill = {**body, "max_tokens": 1, "stream": False}
    first = client.post(f"{producer}/v1/completions", json=prefill)
    first.raise_for_status()
    params = first.json().get("kv_transfer_params")
    second = client.post(f"{consumer}/v1/completions", json={**body, "kv_transfer_params": params})
    second.raise_for_status()
    return dict(second.json())


def create_proxy(producer: str, consumer: str) -> FastAPI:
    app = FastAPI()
    client = httpx.Client(timeout=600)

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]) -> dict[str, Any]:
        """The completion, prefilled by the producer and decoded by the consumer."""
        return complete(client, producer, consumer, body)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producer", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_proxy(args.producer, args.consumer), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
