"""The server says whether the core runs compiled: in GET /v1/pool and in its start-up log."""

from typing import Any

import service.core


def test_pool_and_log_report_the_compiled_core(start_server: Any) -> None:
    server = start_server(args=["--log-level", "info"])
    body = server.client.get("/v1/pool").json()
    assert body["core_compiled"] is True is service.core.is_compiled()  # the tests run on the installed build
    assert server.stop() == 0
    log = server.output
    assert "core compiled: True" in log and "attention backend cpu" in log, log
