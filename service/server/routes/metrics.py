"""Prometheus scrape endpoint."""

from fastapi import Request
from starlette.responses import Response

from service.server.metrics import MetricsDep
from service.server.routes.table import RouteTable

routes = RouteTable(tags=["operations"])

EXPOSITION_FORMATS = {
    200: {
        "description": "Prometheus text format 0.0.4, or OpenMetrics when the Accept header asks for it",
        "content": {"text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {}},
    }
}


@routes.get("/metrics", response_class=Response, responses=EXPOSITION_FORMATS)
async def metrics(request: Request, metrics: MetricsDep) -> Response:
    """Pool occupancy, prefix-cache, eviction and latency metrics for Prometheus."""
    # async on purpose: the collector reads the pool on the event loop, where every other access runs.
    body, content_type = metrics.render(request.headers.get("accept", ""))
    return Response(body, headers={"Content-Type": content_type})
