"""Process supervisor for `ludic up`: start services, watch them, restart the ones that
may be restarted, stop them all.

Each service runs in its own session (process group) with stdout+stderr appended to
``<run_dir>/logs/<name>.log``. ``shutdown()`` sends SIGTERM to every group (newest
first, so producers stop before the stores they write to), waits ``grace_s``, then
SIGKILLs what is left: no orphan survives a Ctrl-C, including vLLM's engine workers and
torchrun's ranks, which live in their service's group. On Linux every service also gets
SIGTERM from the kernel when the supervising process dies (``PR_SET_PDEATHSIG``): a
SIGKILL of ``ludic up`` leaves nothing behind (each service stops its own children on
SIGTERM).

Secrets: a service inherits none of `ludic up`'s secret-bearing variables
(libludic/secret_env.py) unless its spec keeps them; the secrets it needs (its Redis URL,
a token) reach it as sealed in-memory files whose ``/dev/fd/<n>`` path a ``*_FILE``
variable names, made anew at every start (``ServiceSpec.secrets``).

Restarts: a service whose spec says ``restart`` is started again when it exits, after a
back-off that doubles from ``restart_backoff_s`` (reset once it has run
``stable_after_s``), at most ``max_restarts`` times in a row; ``restarts`` counts them.

Watchdog (``watchdog_timeout_s`` > 0): a live service can be stuck (a hung event loop, a
deadlock) without exiting. Each service with a ``health_url`` is polled every
``watchdog_interval_s`` from a thread of its own (launcher/watchdog.py) once it has passed
a health check; when its endpoint has not answered 200 for ``watchdog_timeout_s`` while its
process lives, ``restart_exited`` SIGKILLs its process group and treats it like any exited
service: restarted if its spec allows, else an exit for good (code -9);
``watchdog_kills`` counts them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libludic.retry import Backoff
from libludic.secret_env import SECRET_ENV, child_env, is_secret_name
from services.common.secrets import FD_PATH, secret_fd
from services.common.settings import redact_url
from services.launcher import probes
from services.launcher.watchdog import HealthWatch

log = logging.getLogger("ludic.up")
PR_SET_PDEATHSIG = 1


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None  # polled until 200
    metrics_url: str | None = None
    critical: bool = True  # its death stops the run
    # a job that may finish its work (exit 0) before its first health check passes (the
    # learner of a short run): that exit is success, not a failed start
    may_finish: bool = False
    # for a may_finish service: did its exit 0 finish its work? (None: every exit 0 did.) An
    # exit 0 that did not (a SIGTERM from outside `ludic up` stopped it) is a stop like a
    # crash: restarted when ``restart`` allows, else an exit for good
    finished: Callable[[], bool] | None = None
    restart: bool = False  # start it again when it exits (see the module docstring)
    restart_env: dict[str, str] = field(default_factory=dict)  # added on restarts (e.g. resume)
    # the CPU cores it (and every process it starts) may run on; None: any (launcher/cpus.py)
    cpus: tuple[int, ...] | None = None
    # written to its stdin at every start, then closed (a secret it reads there stays out of
    # its argv, which every local user can read in /proc/<pid>/cmdline)
    stdin: bytes | None = field(default=None, repr=False)
    # ``{"LUDIC_REDIS_URL_FILE": url}``: at every start each value is handed over in a sealed
    # memfd and the variable names its path, /dev/fd/<n> (services/common/secrets.py,
    # ``secret_fd``); never a value in the environment
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    # secret-bearing variables of `ludic up`'s own environment it inherits (every other one
    # is dropped: libludic/secret_env.py), e.g. the learner's WANDB_API_KEY
    keep_env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        held = sorted(k for k in self.env if is_secret_name(k))
        if held:
            raise ValueError(
                f"ServiceSpec {self.name!r}: env carries secret(s) {held} as values; hand "
                "them over in secrets={'<NAME>_FILE': value} (read from a file descriptor)"
            )


class ServiceError(RuntimeError):
    pass


def service_env(spec: ServiceSpec, restarted: bool = False) -> dict[str, str]:
    """The environment a service starts with, its secrets' paths aside: `ludic up`'s own
    without a secret-bearing variable (``child_env``; ``spec.keep_env`` names those it
    keeps) nor a ``*_FILE`` naming one of ludic's secrets (`ludic up` hands over its own),
    then ``spec.env`` (and ``spec.restart_env`` on a restart)."""
    env = child_env(os.environ, keep=spec.keep_env)
    for name in SECRET_ENV:
        env.pop(f"{name}_FILE", None)
    env.update(spec.env)
    if restarted:
        env.update(spec.restart_env)
    return env


def _in_child(parent: int, cpus: tuple[int, ...] | None) -> None:
    """In the child, before exec: its CPU cores, then the parent-death signal."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    _die_with_parent(parent)


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when ``parent`` dies (Linux; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        max_restarts: int = 5,
        restart_backoff_s: float = 1.0,
        stable_after_s: float = 60.0,
        watchdog_timeout_s: float = 0.0,
        watchdog_interval_s: float = 5.0,
        restart_startup_s: float | None = None,
    ) -> None:
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.specs: dict[str, ServiceSpec] = {}
        self.max_restarts = max_restarts
        self.restart_backoff = Backoff(restart_backoff_s, max(restart_backoff_s, 60.0))
        self.stable_after_s = stable_after_s
        self.restarts: dict[str, int] = {}  # every restart of the run, per service
        self._streak: dict[str, int] = {}  # restarts since the service last ran stably
        self._started_at: dict[str, float] = {}
        self._due: dict[str, float] = {}  # name -> when its pending restart is due
        self._given_up: set[str] = set()
        self.watchdog_timeout_s = watchdog_timeout_s  # 0: no watchdog
        self.watchdog_interval_s = watchdog_interval_s
        # a restarted service not healthy this long after its restart is killed as stuck
        # (and restarted again, within max_restarts); None: no deadline
        self.restart_startup_s = restart_startup_s
        self.watchdog_kills: dict[str, int] = {}  # every watchdog kill of the run, per service
        self.watches: dict[str, HealthWatch] = {}  # the running process of each service
        # seconds from a service's exit (or watchdog kill) to its restarted process's first
        # passed health probe (its start, for a service with none), per restart
        self.recoveries: dict[str, list[float]] = {}
        self._down_since: dict[str, float] = {}  # exited, not yet recovered

    def start(self, spec: ServiceSpec) -> subprocess.Popen[bytes]:
        if spec.name in self.procs:
            raise ValueError(f"service {spec.name!r} already started")
        return self._spawn(spec)

    def _spawn(self, spec: ServiceSpec, restarted: bool = False) -> subprocess.Popen[bytes]:
        env = service_env(spec, restarted)
        fds = {var: secret_fd(var.lower(), value) for var, value in spec.secrets.items()}
        env.update({var: f"{FD_PATH}{fd}" for var, fd in fds.items()})
        parent = os.getpid()
        log_file = open(self.log_dir / f"{spec.name}.log", "ab")
        try:
            proc = subprocess.Popen(
                spec.argv,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL if spec.stdin is None else subprocess.PIPE,
                start_new_session=True,
                pass_fds=tuple(fds.values()),
                preexec_fn=lambda: _in_child(parent, spec.cpus),
            )
        finally:  # the child holds its own copies of the descriptors
            log_file.close()
            for fd in fds.values():
                os.close(fd)
        if spec.stdin is not None and proc.stdin is not None:
            try:
                proc.stdin.write(spec.stdin)
                proc.stdin.close()
            except BrokenPipeError:  # it died at once: its exit is handled like any other
                pass
        self.procs[spec.name] = proc
        self.specs[spec.name] = spec
        self._started_at[spec.name] = time.monotonic()
        self._unwatch(spec.name)
        if spec.health_url is not None and self.watchdog_timeout_s > 0:
            self.watches[spec.name] = HealthWatch(
                spec.health_url,
                self.watchdog_interval_s,
                self.watchdog_timeout_s,
                startup_s=self.restart_startup_s if restarted else None,
            ).start()
        return proc

    def _unwatch(self, name: str) -> None:
        watch = self.watches.pop(name, None)
        if watch is not None:
            watch.stop()

    def kill_stuck(self) -> list[str]:
        """SIGKILL the process group of every live service its watch finds stuck (see the
        module docstring); returns their names. Their exits are then ``restart_exited``'s."""
        killed = []
        now = time.monotonic()
        for name, watch in list(self.watches.items()):
            proc = self.procs[name]
            failing = watch.stuck_for(now)
            if failing is None or proc.poll() is not None:
                continue
            if watch.passes:
                log.error(
                    "watchdog: %s (pid %d) has failed its health probe at %s for %.0f s "
                    "(up.watchdog_timeout_s=%g); last error: %s; killing its process group",
                    name,
                    proc.pid,
                    redact_url(watch.url),
                    failing,
                    self.watchdog_timeout_s,
                    watch.last_error,
                )
            else:
                log.error(
                    "watchdog: restarted %s (pid %d) has not become healthy at %s in %.0f s "
                    "(up.startup_timeout_s); last error: %s; killing its process group",
                    name,
                    proc.pid,
                    redact_url(watch.url),
                    failing,
                    watch.last_error,
                )
            self._unwatch(name)
            _signal_group(proc, signal.SIGKILL)  # not waited for: dead() sees it go
            self.watchdog_kills[name] = self.watchdog_kills.get(name, 0) + 1
            killed.append(name)
        return killed

    def restart_exited(self) -> dict[str, int]:
        """Kill the stuck services (``kill_stuck``), then restart the exited services whose
        spec allows it, once their back-off is over. Returns the services that exited and
        will not be restarted (name -> exit code): no ``restart`` in their spec, or
        ``max_restarts`` in a row used up."""
        self.kill_stuck()
        final: dict[str, int] = {}
        now = time.monotonic()
        for name, code in self.dead().items():
            self._unwatch(name)
            spec = self.specs[name]
            if not spec.restart or name in self._given_up or self.finished(name, code):
                final[name] = code
                continue
            due = self._due.get(name)
            if due is None:  # its exit is new
                self._down_since.setdefault(name, now)  # a failed restart keeps the first
                if now - self._started_at[name] >= self.stable_after_s:
                    self._streak[name] = 0
                streak = self._streak.get(name, 0)
                if streak >= self.max_restarts:
                    log.error(
                        "%s exited with code %s after %d restarts in a row; giving up",
                        name,
                        code,
                        streak,
                    )
                    self._given_up.add(name)
                    final[name] = code
                    continue
                delay = self.restart_backoff.delay(streak)
                self._due[name] = now + delay
                log.warning(
                    "%s exited with code %s; restart %d/%d in %.0f s (log: %s)",
                    name,
                    code,
                    streak + 1,
                    self.max_restarts,
                    delay,
                    self.log_dir / f"{name}.log",
                )
                continue
            if now < due:
                continue
            del self._due[name]
            self._streak[name] = self._streak.get(name, 0) + 1
            self.restarts[name] = self.restarts.get(name, 0) + 1
            _signal_group(self.procs[name], signal.SIGKILL)  # anything it left in its group
            self._spawn(spec, restarted=True)
        self._note_recoveries()
        return final

    def _note_recoveries(self) -> None:
        """Record the recovery of each restarted service whose new process is up: its
        health watch's first pass, else (no watchdog) a probe now, else (no health URL)
        its start."""
        for name, down in list(self._down_since.items()):
            proc, spec = self.procs[name], self.specs[name]
            if proc.poll() is not None or name in self._due:
                continue
            watch = self.watches.get(name)
            if spec.health_url is None:
                up = self._started_at[name]
            elif watch is not None:
                if watch.first_pass is None:
                    continue
                up = watch.first_pass
            elif self.healthy(name):
                up = time.monotonic()
            else:
                continue
            del self._down_since[name]
            self.recoveries.setdefault(name, []).append(round(max(0.0, up - down), 1))
            log.info("%s recovered %.1f s after it went down", name, up - down)

    def finished(self, name: str, code: int | None) -> bool:
        """Whether ``name`` exited with ``code`` because its work is done (``may_finish``,
        exit 0 and, when its spec can tell, ``finished()``)."""
        spec = self.specs[name]
        if not spec.may_finish or code != 0:
            return False
        return spec.finished is None or spec.finished()

    def log_tail(self, name: str, lines: int = 20) -> str:
        p = self.log_dir / f"{name}.log"
        if not p.exists():
            return ""
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, name: str, timeout_s: float) -> None:
        spec, proc = self.specs[name], self.procs[name]
        if spec.health_url is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                if self.finished(name, proc.returncode):
                    return
                if spec.restart and proc.returncode < 0:
                    # killed by a signal (not a failed start: a bad config exits with a code)
                    # once it had started: its restart is the monitor's, as for any crash
                    log.warning(
                        "%s was killed by signal %d before its first health check passed; "
                        "it is restarted",
                        name,
                        -proc.returncode,
                    )
                    return
                raise ServiceError(
                    f"{name} exited with code {proc.returncode} before becoming healthy; "
                    f"last log lines:\n{self.log_tail(name)}"
                )
            if probes.check(spec.health_url, 2.0) is None:
                return
            time.sleep(0.5)
        raise ServiceError(
            f"{name} not healthy at {redact_url(spec.health_url)} after {timeout_s:.0f}s; see {self.log_dir}/{name}.log"
        )

    def dead(self) -> dict[str, int]:
        """Services that have exited, with their exit codes."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def healthy(self, name: str) -> bool:
        spec, proc = self.specs[name], self.procs[name]
        if proc.poll() is not None:
            return False
        if spec.health_url is None:
            return True
        return probes.check(spec.health_url, 1.0) is None

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        self._unwatch(name)
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(10)
        _signal_group(proc, signal.SIGKILL)  # stragglers left in the group (engine workers)
        return proc.returncode

    def shutdown(self, grace_s: float = 15.0) -> None:
        for name in list(self.watches):
            self._unwatch(name)
        names = list(self.procs)[::-1]
        for n in names:
            if self.procs[n].poll() is None:
                _signal_group(self.procs[n], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for n in names:
            try:
                self.procs[n].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for n in names:
            _signal_group(self.procs[n], signal.SIGKILL)
            try:
                self.procs[n].wait(10)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
