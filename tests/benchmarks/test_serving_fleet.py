"""benchmarks/serving/fleet.py: --realtime puts kvpool's servers and redis-server (or one of them) under SCHED_FIFO."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serving import fleet


def realtime_allowed() -> bool:
    return shutil.which("chrt") is not None and subprocess.run(["chrt", "-f", "1", "true"]).returncode == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.skipif(not realtime_allowed(), reason="SCHED_FIFO needs root (CAP_SYS_NICE)")
def test_realtime_services_run_under_sched_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = fleet.redis_service(tmp_path, 1 << 20)
    assert plain.cmd[0] == "redis-server"
    monkeypatch.setitem(fleet.PRIORITY, "redis", fleet.REALTIME)
    redis = fleet.redis_service(tmp_path, 1 << 20)
    with fleet.Fleet() as services:
        services.start([redis], timeout_s=30)
        assert redis.proc is not None
        pid = redis.proc.pid
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/comm").read_text().strip() != "redis-server" and time.monotonic() < deadline:
            time.sleep(0.05)  # (chrt sets the policy, then becomes redis-server)
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        assert tasks and all(os.sched_getscheduler(t) == os.SCHED_FIFO for t in tasks)
        assert os.sched_getparam(pid).sched_priority == 1


@pytest.mark.parametrize("which", [False, "both", "kvpool", "redis"])
def test_realtime_names_which_services_start_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str | bool
) -> None:
    """--realtime [both|kvpool|redis]: the kvpool servers' and redis-server's commands start with chrt -f 1 as named
    (Redis alone ahead stands for a store on a host of its own), the others as they are."""
    monkeypatch.setattr(fleet, "PRIORITY", {"kvpool": [], "redis": []})
    fleet.set_realtime(which)
    kvpool = fleet.kvpool_service(tmp_path, "kvpool-a", tmp_path / "model", 64).cmd
    redis = fleet.redis_service(tmp_path, 1 << 20).cmd
    ahead = {name: fleet.REALTIME if which in ("both", name) else [] for name in ("kvpool", "redis")}
    assert kvpool[: len(ahead["kvpool"]) + 3] == [*ahead["kvpool"], sys.executable, "-m", "service"]
    assert redis[: len(ahead["redis"]) + 1] == [*ahead["redis"], "redis-server"]
