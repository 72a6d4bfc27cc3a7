"""`kvpool bench match` runs and measures what it says (a short prompt, few repetitions)."""

from benchmarks import match


def test_in_process_and_http_figures() -> None:
    local = match.in_process(256, 16, 20)
    assert set(local) == {"hit", "miss", "tier"} and all(v > 0 for v in local.values())
    http = match.over_http(256, 16, 20)
    assert set(http) == {"hit", "miss", "httpx hit"} and all(v > 0 for v in http.values())
