"""Prometheus scrape endpoint."""

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.server.metrics import MetricsDep

router = APIRouter(tags=["operations"])

EXPOSITION_FORMATS = {
    200: {
        "description": "Prometheus text format 0.0.4, or OpenMetrics when the Accept header asks for it",
        "content": {"text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {}},
    }
}


@router.get("/metrics", response_class=Response, responses=EXPOSITION_FORMATS)  # type: ignore[arg-type]
async def metrics(request: Request, metrics: MetricsDep) -> Response:
    """Pool occupancy, prefix-cache, eviction and latency metrics for Prometheus."""
    # async on purpose: the collector reads the pool on the event loop, where every other access runs.
    body, content_type = metrics.render(request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})
