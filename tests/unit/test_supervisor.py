"""The launcher's supervisor: a job that finishes before its first health check."""

from __future__ import annotations

import sys

import pytest

from services.launcher.supervisor import ServiceError, ServiceSpec, Supervisor


def test_a_finished_job_is_not_a_failed_start(tmp_path) -> None:
    """A short run's learner can train all its steps and exit 0 before the launcher's first
    health poll (seen in CI: 3 steps in 0.5 s); that is success. Any other early exit, or a
    non-job service exiting, is a failed start."""
    sup = Supervisor(tmp_path)
    closed = "http://127.0.0.1:9/metrics"  # nothing listens: the poll never passes
    for name, code, may_finish, ok in [("job", 0, True, True), ("crash", 3, True, False),
                                       ("svc", 0, False, False)]:
        sup.start(ServiceSpec(name, [sys.executable, "-c", f"raise SystemExit({code})"],
                              health_url=closed, may_finish=may_finish))
        sup.procs[name].wait(30)
        if ok:
            sup.wait_healthy(name, 10)
        else:
            with pytest.raises(ServiceError, match=f"{name} exited with code {code} before becoming healthy"):
                sup.wait_healthy(name, 10)
