"""Process supervisor for `ludic up`: start services, watch them, stop them all.

Each service runs in its own session (process group) with stdout+stderr appended to
``<run_dir>/logs/<name>.log``. ``shutdown()`` sends SIGTERM to every group (newest
first, so producers stop before the stores they write to), waits ``grace_s``, then
SIGKILLs what is left: no orphan survives a Ctrl-C, including vLLM's engine workers and
torchrun's ranks, which live in their service's group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


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


class ServiceError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, run_dir: Path) -> None:
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.specs: dict[str, ServiceSpec] = {}

    def start(self, spec: ServiceSpec) -> subprocess.Popen[bytes]:
        if spec.name in self.procs:
            raise ValueError(f"service {spec.name!r} already started")
        log = open(self.log_dir / f"{spec.name}.log", "ab")
        env = {**os.environ, **spec.env}
        proc = subprocess.Popen(
            spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        self.procs[spec.name] = proc
        self.specs[spec.name] = spec
        return proc

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
                if spec.may_finish and proc.returncode == 0:
                    return
                raise ServiceError(
                    f"{name} exited with code {proc.returncode} before becoming healthy; "
                    f"last log lines:\n{self.log_tail(name)}"
                )
            try:
                if httpx.get(spec.health_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServiceError(f"{name} not healthy at {spec.health_url} after {timeout_s:.0f}s; see {self.log_dir}/{name}.log")

    def dead(self) -> dict[str, int]:
        """Services that have exited, with their exit codes."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def healthy(self, name: str) -> bool:
        spec, proc = self.specs[name], self.procs[name]
        if proc.poll() is not None:
            return False
        if spec.health_url is None:
            return True
        try:
            return httpx.get(spec.health_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(10)
        _signal_group(proc, signal.SIGKILL)  # stragglers left in the group (engine workers)
        return proc.returncode

    def shutdown(self, grace_s: float = 15.0) -> None:
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
