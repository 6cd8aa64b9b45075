"""The embedded redis-server of `ludic up`: a password of the run's own that never shows in
its argv, and a watchdog PING that restarts it when it stops answering (a stopped process
is alive to its supervisor but serves nobody)."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import pytest
import redis

from services.launcher import probes, stack
from services.launcher.supervisor import Supervisor


def _until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path: Path):
    """A supervised redis-server with a password, its watchdog probing every 0.2 s and
    calling it stuck after 1 s without a PONG."""
    password = secrets.token_hex(24)
    port = stack.free_port()
    sup = Supervisor(
        tmp_path, restart_backoff_s=0.1, watchdog_timeout_s=1.0, watchdog_interval_s=0.2
    )
    spec = stack.redis_spec(tmp_path / "redis", port, password)
    sup.start(spec)
    try:
        stack.wait_redis(port, password=password)
        yield sup, port, password
    finally:
        sup.shutdown(grace_s=2)


def test_it_requires_the_run_password_that_its_argv_does_not_show(served) -> None:
    sup, port, password = served
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, password="not-it").ping()
    r = redis.Redis(port=port, password=password)
    r.xadd("s", {"k": "v"})
    assert r.xlen("s") == 1
    pid = sup.procs["redis"].pid
    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert password.encode() not in argv and b"requirepass" not in argv
    assert probes.check(f"redis://:{password}@127.0.0.1:{port}/0", 1.0) is None
    why = probes.check(f"redis://:wrong-{password}@127.0.0.1:{port}/0", 1.0)
    assert why is not None and password not in why  # a reason, never the secret


def test_a_stopped_redis_is_killed_by_the_watchdog_and_restarted_with_its_data(served) -> None:
    sup, port, password = served
    r = redis.Redis(port=port, password=password, socket_timeout=5)
    r.xadd("s", {"k": "v"})
    r.execute_command("BGREWRITEAOF")  # on disk now, not only within the next second
    _until(lambda: r.info("persistence")["aof_rewrite_in_progress"] == 0)
    _until(lambda: sup.watches["redis"].passes > 0)  # armed: it served (watchdog.py)
    first = sup.procs["redis"].pid
    os.kill(first, signal.SIGSTOP)  # alive, answering nothing
    _until(lambda: sup.kill_stuck() == ["redis"])
    assert sup.watchdog_kills == {"redis": 1}
    _until(lambda: sup.restart_exited() == {} and sup.restarts.get("redis") == 1)
    assert sup.procs["redis"].pid != first
    stack.wait_redis(port, password=password)  # the restart reads the password again
    assert redis.Redis(port=port, password=password).xlen("s") == 1
