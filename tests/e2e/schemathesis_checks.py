"""Custom schemathesis checks for kvpool, loaded by the CLI through SCHEMATHESIS_HOOKS.

Not a test module: tests/e2e/test_schemathesis.py runs `schemathesis run` against a live server
with this module as its hooks.
"""

from typing import Any

import schemathesis

# 507 is kvpool's documented answer to a pool that is full: a capacity condition, not a crash.
CAPACITY_STATUSES = {507: "out_of_pages"}


def _error_body(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{response.status_code} body is not JSON: {response.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise AssertionError(f"{response.status_code} body is not a JSON object: {body!r}")
    return body


@schemathesis.check
def error_envelope(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx/5xx body is exactly {"error": {"code": str, "message": str}}, both non-empty, plus a
    non-empty "details" object where the error has fields."""
    if response.status_code < 400:
        return None
    body = _error_body(response)
    error = body.get("error")
    if set(body) != {"error"} or not isinstance(error, dict) or set(error) - {"details"} != {"code", "message"}:
        raise AssertionError(f"{response.status_code} body is not the error envelope: {body!r}")
    if "details" in error and not (isinstance(error["details"], dict) and error["details"]):
        raise AssertionError(f"{response.status_code} envelope has details that are not a non-empty object: {body!r}")
    if not all(isinstance(error[k], str) and error[k] for k in ("code", "message")):
        raise AssertionError(f"{response.status_code} envelope has an empty or non-string field: {body!r}")
    return None


@schemathesis.check
def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx, except 507 `out_of_pages` (the pool is full, as documented)."""
    status = response.status_code
    if status < 500:
        return None
    if status in CAPACITY_STATUSES:
        code = _error_body(response).get("error", {}).get("code")
        if code == CAPACITY_STATUSES[status]:
            return None
    raise AssertionError(f"server error {status}: {response.text[:500]}")
