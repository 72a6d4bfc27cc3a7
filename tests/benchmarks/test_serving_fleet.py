"""benchmarks/serving/fleet.py: --realtime puts kvpool's servers and redis-server under SCHED_FIFO."""

import os
import shutil
import subprocess
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
    monkeypatch.setattr(fleet, "PRIORITY", ["chrt", "-f", "1"])
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
