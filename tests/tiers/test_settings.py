"""The tier settings: refused at start with a message naming the variable, shown in GET /v1/pool."""

from typing import Any

import pytest
from pydantic import ValidationError

from service.config import Settings, describe_errors


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"spill": "disk"}, "KVPOOL_SPILL=disk needs KVPOOL_SPILL_PATH"),
        ({"spill": "host", "enable_prefix_caching": False}, "need KVPOOL_ENABLE_PREFIX_CACHING=true"),
        ({"remote_url": "http://x:6379"}, "redis://"),
        ({"remote_url": "redis+cluster://a:7000,b:7001/3"}, "KVPOOL_REMOTE_URL: a Redis Cluster has only database 0"),
        ({"remote_url": "redis+cluster://a:port"}, "host:port seeds"),
        ({"remote_url": "redis+cluster://a:1?ssl_ca_certs=x"}, "takes no options but ssl_ca_certs"),
        ({"spill": "host", "spill_bytes": 100}, "holds no page"),
        ({"spill": "tape"}, "KVPOOL_SPILL"),
        ({"remote_url": "redis://a:1", "remote_secret": "too short"}, "KVPOOL_REMOTE_SECRET must be 16 characters"),
    ],
)
def test_bad_tier_settings_are_refused(env: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(**env)
    assert says in describe_errors(info.value)


def test_a_spill_path_that_is_no_directory_stops_the_start(tmp_path: Any) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO, SMALL_POOL

    env = {**SMALL_POOL, "KVPOOL_SPILL": "disk", "KVPOOL_SPILL_PATH": str(tmp_path / "missing")}
    cmd = [sys.executable, "-m", "service", "serve", "--port", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env={"PATH": "", **env, "PYTHONPATH": str(REPO)}, capture_output=True)
    assert proc.returncode == 2
    assert b"cannot start: KVPOOL_SPILL_PATH=" in proc.stderr and b"is not a directory" in proc.stderr


def test_pool_shows_each_tier(start_server: Any, tmp_path: Any) -> None:
    from tests.tiers.helpers import run_prompt

    c = start_server({"KVPOOL_SPILL": "host", "KVPOOL_SPILL_BYTES": str(8 * 2048)}).client
    for i in range(6):  # 24 pages through a pool of 16: 8 evicted, into the tier's 8 slots
        run_prompt(c, f"s{i}", i)
    (tier,) = c.get("/v1/pool").json()["tiers"]
    assert tier["tier"] == "host" and tier["up"] is True
    assert tier["capacity_bytes"] == 8 * 2048 and tier["capacity_entries"] == 8
    assert tier["entries"] == 8 and tier["used_bytes"] == 8 * 2048
    assert tier["bytes_out"] == 8 * 2048 and tier["hits"] == 0 and tier["errors"] == 0
