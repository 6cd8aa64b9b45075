"""The supervisor's watchdog (``up.watchdog_timeout_s``), on real child processes: a small
HTTP server that stops answering while its process lives is killed (its whole process
group) and restarted, or ends as an exit for good when its spec allows no restart; one that
answers slowly, or fails for stretches shorter than the limit, is left alone.

Timings: limit L = 2 s, probes every I = 0.25 s. A server stuck from t_s is killed by
t_s + I + L (its next probe starts within I and times out after L); the assertions allow
5 s more for a loaded 2-core machine. The slow server answers in 0.5 s: 1.5 s inside L.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.launcher.settings import UpSettings
from services.launcher.stack import free_port
from services.launcher.supervisor import ServiceSpec, Supervisor
from services.launcher.worker import Run

LIMIT_S, INTERVAL_S, SLACK_S = 2.0, 0.25, 5.0

# argv: port, mode, directory. Every 200 appends time.monotonic() (one clock for every
# process on Linux) to <dir>/ok (<dir>/ok-restarted with RESTARTED set). Modes: stick (answers until <dir>/stick exists, then its
# only thread sleeps in the handler, unless RESTARTED is set: the process lives, its
# endpoint is dead), slow (every answer after 0.5 s), flaky (503 for the first 0.7 s
# of every 1.1 s of the shared clock: whoever probes, however often, sees both; 1.1 s is
# no multiple of the 0.5 s start-up poll, whose probes so land in every phase),
# late (listens only after LATE_S seconds: a slow start).
# With <dir>/child it first starts a child process in its group and writes its pid there.
SERVER = """
import http.server, os, pathlib, subprocess, sys, time
port, mode, d = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
if mode == "late":
    time.sleep(float(os.environ["LATE_S"]))
if (d / "child").exists():
    c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (d / "child").write_text(str(c.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if mode == "stick" and (d / "stick").exists() and not os.environ.get("RESTARTED"):
            time.sleep(3600)
        if mode == "slow":
            time.sleep(0.5)
        code = 503 if mode == "flaky" and time.monotonic() % 1.1 < 0.7 else 200
        self.send_response(code)
        self.end_headers()
        if code == 200:
            with open(d / ("ok-restarted" if os.environ.get("RESTARTED") else "ok"), "a") as f:
                f.write(f"{time.monotonic()}\\n")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _server(name: str, mode: str, d: Path, **kw: object) -> ServiceSpec:
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    return ServiceSpec(
        name,
        [sys.executable, "-c", SERVER, str(port), mode, str(d)],
        health_url=f"http://127.0.0.1:{port}/health",
        **kw,  # type: ignore[arg-type]
    )


def _until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _last_ok(d: Path) -> float:
    return float((d / "ok").read_text().split()[-1])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie until its new parent reaps it is gone
        return f.read().split(")")[-1].split()[0] == "Z"


def _supervisor(tmp_path: Path) -> Supervisor:
    return Supervisor(
        tmp_path,
        restart_backoff_s=0.1,
        watchdog_timeout_s=LIMIT_S,
        watchdog_interval_s=INTERVAL_S,
    )


def test_a_stuck_service_is_killed_after_the_limit_and_restarted(tmp_path, caplog) -> None:
    d = tmp_path / "svc"
    sup = _supervisor(tmp_path)
    sup.start(_server("svc", "stick", d, restart=True, restart_env={"RESTARTED": "1"}))
    try:
        sup.wait_healthy("svc", 30)
        _until(lambda: sup.watches["svc"].passes > 0, 10)  # armed
        first = sup.procs["svc"]
        (d / "stick").touch()
        stuck_at = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="ludic.up"):
            _until(lambda: sup.restart_exited() == {} and sup.restarts.get("svc") == 1, 30)
        restarted_at = time.monotonic()
        # killed, not exited by itself; and not before it had failed for the whole limit:
        # its last 200 was before the first failing probe started
        assert first.returncode == -signal.SIGKILL
        assert restarted_at - _last_ok(d) >= LIMIT_S
        assert restarted_at - stuck_at < INTERVAL_S + LIMIT_S + SLACK_S
        assert sup.watchdog_kills == {"svc": 1}
        (why,) = [r.getMessage() for r in caplog.records if "watchdog" in r.getMessage()]
        assert f"svc (pid {first.pid}) has failed its health probe" in why
        assert "ReadTimeout" in why
        # the restarted one answers (RESTARTED is set): watched again, left alone
        sup.wait_healthy("svc", 30)
        _until(lambda: sup.watches["svc"].passes > 0, 10)
        time.sleep(LIMIT_S + 4 * INTERVAL_S)
        assert sup.restart_exited() == {} and sup.procs["svc"].poll() is None
        assert sup.restarts == {"svc": 1} and sup.watchdog_kills == {"svc": 1}
    finally:
        sup.shutdown(grace_s=2)


def test_a_stuck_service_without_restart_is_an_exit_for_good_with_its_group(tmp_path) -> None:
    d = tmp_path / "svc"
    d.mkdir()
    (d / "child").touch()
    sup = _supervisor(tmp_path)
    sup.start(_server("svc", "stick", d))  # no restart
    try:
        sup.wait_healthy("svc", 30)
        _until(lambda: (d / "child").read_text() != "", 10)
        child = int((d / "child").read_text())
        _until(lambda: sup.watches["svc"].passes > 0, 10)
        (d / "stick").touch()
        stuck_at = time.monotonic()
        finals: dict[str, int] = {}
        _until(lambda: finals.update(sup.restart_exited()) or finals, INTERVAL_S + LIMIT_S + 30)
        assert time.monotonic() - stuck_at < INTERVAL_S + LIMIT_S + SLACK_S
        # the path of any service that exited and may not restart: the launcher stops the run
        assert finals == {"svc": -signal.SIGKILL}
        assert sup.restarts == {} and sup.watchdog_kills == {"svc": 1}
        _until(lambda: _gone(child), 10)  # its whole process group
    finally:
        sup.shutdown(grace_s=2)


def test_slow_starting_slow_or_briefly_failing_services_are_left_alone(tmp_path) -> None:
    """Each slow answer takes 0.5 s (a probe timeout under that would kill it within
    L + 0.5 s); the flaky one fails 0.7 s in every 1.1 s (with the probe interval, under 1 s in a
    row), never L; the late one refuses connections for L + 1 s from its start (a watch armed before its first
    pass would kill it at L), then answers."""
    sup = _supervisor(tmp_path)
    modes = ("slow", "flaky", "late")
    for mode in modes:
        env = {"LATE_S": str(LIMIT_S + 1)}
        sup.start(_server(mode, mode, tmp_path / mode, restart=True, env=env))
    try:
        for mode in ("slow", "flaky"):
            sup.wait_healthy(mode, 30)
        t0 = time.monotonic()
        # at least 2 L, and until every watch has seen two passes (the late one, ~L + 1 s)
        while time.monotonic() - t0 < 2 * LIMIT_S or min(sup.watches[m].passes for m in modes) < 2:
            assert sup.restart_exited() == {} and sup.watchdog_kills == {}
            passes = {m: sup.watches[m].passes for m in modes}
            assert time.monotonic() - t0 < 30, f"timed out; watch passes: {passes}"
            time.sleep(0.1)
        assert sup.restarts == {} and sup.watchdog_kills == {}
        for mode in modes:
            assert sup.procs[mode].poll() is None
            assert time.monotonic() - _last_ok(tmp_path / mode) < LIMIT_S
        assert sup.watches["flaky"].last_error.startswith("HTTP 503")
    finally:
        sup.shutdown(grace_s=2)


def test_watchdog_settings_are_checked_and_reach_the_supervisor(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"up.watchdog_timeout_s=-1 must be >= 0"):
        UpSettings(watchdog_timeout_s=-1)
    with pytest.raises(ValueError, match=r"up.watchdog_interval_s=0 must be > 0"):
        UpSettings(watchdog_interval_s=0)
    s = UpSettings(runs_dir=str(tmp_path), watchdog_timeout_s=90, watchdog_interval_s=3)
    sup = Run(s).sup
    assert (sup.watchdog_timeout_s, sup.watchdog_interval_s) == (90, 3)
    # 0 turns it off: no watch even for a service with a health URL
    off = Supervisor(tmp_path, watchdog_timeout_s=0)
    off.start(_server("svc", "slow", tmp_path / "off"))
    try:
        assert off.watches == {}
    finally:
        off.shutdown(grace_s=2)


def test_a_restart_that_never_comes_up_is_killed_after_the_start_up_limit(tmp_path, caplog) -> None:
    """The first run crashes; every restart hangs before it listens (a learner stuck
    loading its checkpoint): each is killed ``restart_startup_s`` after it began, until
    ``max_restarts`` are used up, and the service ends as an exit for good. A first start
    has no such deadline (``wait_healthy`` times it; the test above leaves slow starts alone)."""
    port = free_port()
    code = "import os, sys, time\nif not os.environ.get('RESTARTED'):\n    sys.exit(1)\ntime.sleep(3600)"
    sup = Supervisor(
        tmp_path,
        max_restarts=2,
        restart_backoff_s=0.1,
        watchdog_timeout_s=LIMIT_S,
        watchdog_interval_s=INTERVAL_S,
        restart_startup_s=1.0,
    )
    spec = ServiceSpec(
        "svc",
        [sys.executable, "-c", code],
        health_url=f"http://127.0.0.1:{port}/health",
        restart=True,
        restart_env={"RESTARTED": "1"},
    )
    sup.start(spec)
    finals: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.ERROR, logger="ludic.up"):
            _until(lambda: bool(finals.update(sup.restart_exited()) or finals), 40)
        assert finals == {"svc": -signal.SIGKILL}
        assert sup.restarts == {"svc": 2} and sup.watchdog_kills == {"svc": 2}
        assert time.monotonic() - t0 >= 2 * 1.0  # each restart had its second
        msgs = [
            r.getMessage() for r in caplog.records if "has not become healthy" in r.getMessage()
        ]
        assert len(msgs) == 2 and "restarted svc" in msgs[0]
    finally:
        sup.shutdown(grace_s=2)
