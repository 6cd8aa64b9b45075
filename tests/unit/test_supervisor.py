"""The launcher's supervisor: a job that finishes before its first health check, restarts
with back-off and a limit, and services that die with `ludic up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.launcher.supervisor import ServiceError, ServiceSpec, Supervisor


def test_a_finished_job_is_not_a_failed_start(tmp_path) -> None:
    """A short run's learner can train all its steps and exit 0 before the launcher's first
    health poll (a tiny model trains 3 steps in half a second); that is success. Any other early exit, or a
    non-job service exiting, is a failed start."""
    sup = Supervisor(tmp_path)
    closed = "http://127.0.0.1:9/metrics"  # nothing listens: the poll never passes
    for name, code, may_finish, ok in [
        ("job", 0, True, True),
        ("crash", 3, True, False),
        ("svc", 0, False, False),
    ]:
        sup.start(
            ServiceSpec(
                name,
                [sys.executable, "-c", f"raise SystemExit({code})"],
                health_url=closed,
                may_finish=may_finish,
            )
        )
        sup.procs[name].wait(30)
        if ok:
            sup.wait_healthy(name, 10)
        else:
            with pytest.raises(
                ServiceError, match=f"{name} exited with code {code} before becoming healthy"
            ):
                sup.wait_healthy(name, 10)


def test_a_restartable_service_killed_while_starting_is_left_to_its_restart(tmp_path) -> None:
    """A SIGKILL (an OOM kill, a fault test) of a service whose spec restarts it, before the
    launcher's first health check passed, is a crash to restart, not a failed start; a
    service that exits with a code (a bad config) still fails the start."""
    sup = Supervisor(tmp_path, restart_backoff_s=0.05)
    closed = "http://127.0.0.1:9/metrics"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    sup.start(ServiceSpec("killed", sleeper, health_url=closed, restart=True))
    sup.start(ServiceSpec("once", list(sleeper), health_url=closed))
    sup.start(
        ServiceSpec(
            "badcfg", [sys.executable, "-c", "raise SystemExit(2)"], health_url=closed, restart=True
        )
    )
    try:
        for name in ("killed", "once"):
            os.kill(sup.procs[name].pid, signal.SIGKILL)
            sup.procs[name].wait(10)
        sup.wait_healthy("killed", 10)  # returns: the monitor restarts it
        with pytest.raises(ServiceError, match="once exited with code -9 before becoming healthy"):
            sup.wait_healthy("once", 10)
        sup.procs["badcfg"].wait(10)
        with pytest.raises(ServiceError, match="badcfg exited with code 2 before becoming healthy"):
            sup.wait_healthy("badcfg", 10)
        _until(
            lambda: sup.restart_exited().get("killed") is None and sup.restarts.get("killed") == 1
        )
    finally:
        sup.shutdown(grace_s=2)


def _until(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_crashing_service_is_restarted_with_back_off_up_to_the_limit(tmp_path) -> None:
    sup = Supervisor(tmp_path, max_restarts=2, restart_backoff_s=0.1)
    sup.start(ServiceSpec("w", [sys.executable, "-c", "raise SystemExit(3)"], restart=True))
    sup.start(ServiceSpec("once", [sys.executable, "-c", "raise SystemExit(4)"]))  # no restart
    pids, finals, t0 = set(), {}, time.monotonic()
    while "w" not in finals:
        pids.add(sup.procs["w"].pid)
        finals.update(sup.restart_exited())
        assert time.monotonic() - t0 < 30
        time.sleep(0.01)
    assert finals == {"once": 4, "w": 3}
    assert sup.restarts == {"w": 2} and len(pids) == 3
    assert time.monotonic() - t0 >= 0.1 + 0.2  # back-off doubles: 0.1 s, then 0.2 s


def test_a_restarted_service_that_comes_up_keeps_running(tmp_path) -> None:
    marker = tmp_path / "crashed-once"
    code = (
        f"import pathlib, sys, time\np = pathlib.Path({str(marker)!r})\n"
        "if not p.exists():\n    p.touch(); sys.exit(1)\ntime.sleep(60)"
    )
    sup = Supervisor(tmp_path, max_restarts=1, restart_backoff_s=0.05)
    sup.start(ServiceSpec("w", [sys.executable, "-c", code], restart=True))
    try:
        _until(lambda: sup.restart_exited() == {} and sup.restarts.get("w") == 1)
        time.sleep(0.3)
        assert sup.restart_exited() == {} and sup.procs["w"].poll() is None
    finally:
        sup.shutdown(grace_s=2)


def test_a_job_stopped_before_its_work_is_done_is_restarted_not_finished(tmp_path) -> None:
    """The learner exits 0 both when it reached its step count and when a SIGTERM from
    outside stopped it; its spec's ``finished()`` tells them apart. A stop is restarted like
    a crash; the exit after the work is done is final."""
    done = tmp_path / "done"
    code = f"import pathlib, sys\np = pathlib.Path({str(done)!r})\nsys.exit(0)"
    sup = Supervisor(tmp_path, max_restarts=3, restart_backoff_s=0.05)
    sup.start(
        ServiceSpec(
            "job",
            [sys.executable, "-c", code],
            may_finish=True,
            restart=True,
            finished=done.exists,
        )
    )
    # exit 0 without "done": a stop, restarted
    _until(lambda: sup.restart_exited() == {} and sup.restarts.get("job", 0) >= 1)
    done.touch()
    finals: dict[str, int] = {}
    _until(lambda: bool(finals.update(sup.restart_exited()) or finals))
    assert finals == {"job": 0}
    # a stop before the first health check is a failed start, not a finished job
    sup.specs["job"] = ServiceSpec(
        "job", [], health_url="http://127.0.0.1:9/", may_finish=True, finished=lambda: False
    )
    with pytest.raises(ServiceError, match="job exited with code 0 before becoming healthy"):
        sup.wait_healthy("job", 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_services_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    """SIGKILL of `ludic up` (here a process running a Supervisor) leaves no service behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from services.launcher.supervisor import ServiceSpec, Supervisor
        sup = Supervisor(Path({str(tmp_path)!r}))
        p = sup.start(ServiceSpec("svc", [sys.executable, "-c", "import time; time.sleep(120)"]))
        print(p.pid, flush=True)
        time.sleep(120)
    """)
    up = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    svc = int(up.stdout.readline())
    os.kill(svc, 0)  # running
    up.send_signal(signal.SIGKILL)
    up.wait(10)

    def gone() -> bool:
        try:
            os.kill(svc, 0)
        except ProcessLookupError:
            return True
        # a zombie until init reaps it counts as gone
        with open(f"/proc/{svc}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"

    _until(gone, 10)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_a_service_and_its_children_run_on_the_cores_of_its_spec(tmp_path: Path) -> None:
    """``ServiceSpec.cpus`` is applied before exec; a process the service starts inherits it
    (vLLM's EngineCore and worker, torchrun's ranks)."""
    core = max(os.sched_getaffinity(0))
    out = tmp_path / "affinity"
    child = f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))"
    parent = (
        f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    )
    sup = Supervisor(tmp_path)
    sup.start(ServiceSpec("pinned", [sys.executable, "-c", parent], cpus=(core,)))
    assert sup.procs["pinned"].wait(30) == 0
    assert out.read_text() == repr([core])
    sup.start(ServiceSpec("free", [sys.executable, "-c", parent]))
    assert sup.procs["free"].wait(30) == 0
    assert out.read_text() == repr(sorted(os.sched_getaffinity(0)))


def test_a_restart_records_its_recovery_time_to_the_first_health_pass(tmp_path: Path) -> None:
    """Recovery = from the exit seen to the new process's first passed probe: at least the
    restart back-off (0.5 s here), and only once the new process serves."""
    from services.launcher import stack

    port = stack.free_port()
    web = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    sup = Supervisor(
        tmp_path, restart_backoff_s=0.5, watchdog_timeout_s=30, watchdog_interval_s=0.1
    )
    sup.start(ServiceSpec("web", web, health_url=f"http://127.0.0.1:{port}/", restart=True))
    sup.start(
        ServiceSpec("bare", [sys.executable, "-c", "import time; time.sleep(60)"], restart=True)
    )
    try:
        sup.wait_healthy("web", 20)
        assert sup.recoveries == {}  # a first start is no recovery
        for name in ("web", "bare"):
            os.kill(sup.procs[name].pid, signal.SIGKILL)
        _until(lambda: sup.restart_exited() == {} and len(sup.recoveries) == 2)
        assert sup.healthy("web")
        assert set(sup.recoveries) == {"web", "bare"}
        assert all(len(v) == 1 and 0.5 <= v[0] < 15 for v in sup.recoveries.values())
    finally:
        sup.shutdown(grace_s=2)
