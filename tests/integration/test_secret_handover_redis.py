"""A real service reaches a real Redis with the URL `ludic up` hands it as a sealed
in-memory file: the launcher's supervisor starts redis-server with the run's users and the
credit service with ``LUDIC_REDIS_URL_FILE=/dev/fd/<n>``; the service connects as its role's
user, and no environment of either process holds a password."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from services.common.redis_acl import ADMIN, RunUsers
from services.launcher import stack
from services.launcher.supervisor import ServiceSpec, Supervisor
from services.launcher.worker import LUDIC

pytestmark = pytest.mark.integration


def test_a_service_reaches_redis_with_the_url_handed_over_as_a_file(tmp_path: Path) -> None:
    run_id = "handover"
    users = RunUsers(run_id)
    port, metrics = stack.free_port(), stack.free_port()
    sup = Supervisor(tmp_path)
    try:
        sup.start(stack.redis_spec(tmp_path / "redis", port, users=users))
        stack.wait_redis(port, url=users.url(ADMIN, "127.0.0.1", port))
        sup.start(
            ServiceSpec(
                "credit",
                LUDIC + ["credit"],
                env={
                    "LUDIC_RUN_ID": run_id,
                    "LUDIC_METRICS_PORT": str(metrics),
                    "LUDIC_METRICS_HOST": "127.0.0.1",
                },
                secrets={"LUDIC_REDIS_URL_FILE": users.url("credit", "127.0.0.1", port)},
                health_url=f"http://127.0.0.1:{metrics}/health",
            )
        )
        sup.wait_healthy("credit", 120)
        admin = redis.Redis.from_url(users.url(ADMIN, "127.0.0.1", port))
        deadline = time.monotonic() + 30
        while "user=ludic-credit" not in str(admin.execute_command("CLIENT", "LIST")):
            assert time.monotonic() < deadline, "the credit service never connected"
            time.sleep(0.2)
        admin.close()
        for name in ("credit", "redis"):
            environ = Path(f"/proc/{sup.procs[name].pid}/environ").read_bytes()
            assert not [p for p in users.passwords.values() if p.encode() in environ], name
        environ = Path(f"/proc/{sup.procs['credit'].pid}/environ").read_bytes()
        assert b"LUDIC_REDIS_URL_FILE=/dev/fd/" in environ
    finally:
        sup.shutdown(grace_s=5)
