"""Run UNTRUSTED Python source in a subprocess sandbox and report how it ended.

Contract: ``Sandbox.run(source, stdin=..., timeout_s=..., memory_limit_mb=...)`` always
returns an ``ExecResult`` within about ``timeout_s`` + 1 s (plus interpreter start-up), never
raises for anything the code does, and leaves no process, and no file outside the system
temp dir, behind. ``ExecResult.status`` is one of ``ok``, ``error``, ``timeout``,
``memory``, ``output_limit``, ``too_many_processes``, ``signal``; ``ExecResult.reason`` is the
human string the env reports (``"runtime_error: ZeroDivisionError: ..."``).

:class:`SubprocessSandbox` runs each program as ``python -I`` in a fresh temp dir, with a
scrubbed environment, rlimits, its own session, capped output and a watchdog, in one of two
isolation modes (``isolation="auto"`` picks the strongest that works, probed once per
sandbox by running a real program through it): ``namespace`` (a root host with util-linux:
fresh namespaces, read-only mounts, a fresh uid per run; :func:`namespace_command`) or
``plain`` (rlimits, a fresh uid when the host is root, and Landlock).
In both modes a seccomp filter stops the code opening any socket (``seccomp.py``).

Guarantees: three properties must hold in every mode, else the sandbox refuses to run
(``RuntimeError`` naming the missing one) unless ``allow`` lists it (``default_sandbox``
reads ``LUDIC_SANDBOX_ALLOW``, comma-separated): ``network_isolated`` (the code opens no
socket: the seccomp filter holds), ``environment_private`` (the code cannot read the
environment of any process of the run, where services keep their tokens: it runs as another
uid, or inside a Landlock domain beside a non-dumpable host) and
``filesystem_read_only_outside_cwd`` (namespace mode: read-only remounts; plain mode: a
Landlock domain, checked by a probe run). ``describe()`` reports all three.

Thread-safety: ``run`` is re-entrant; concurrent runs get different dirs and uids. Callers
in asyncio run it in a worker thread (``asyncio.to_thread``), see ``CodeExecEnv``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import random
import re
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from libludic.envs.code_exec import landlock
from libludic.envs.code_exec.seccomp import NETWORK_PROBE, python_argv, socket_filter_code

log = logging.getLogger(__name__)
# what every SubprocessSandbox of this process enforces, once probed (described_sandboxes)
_DESCRIBED: dict[int, dict[str, object]] = {}
_DESCRIBED_LOCK = threading.Lock()


def described_sandboxes() -> list[dict[str, object]]:
    """``describe()`` of every SubprocessSandbox this process has probed (a service exports
    them: the actor's ``ludic_actor_sandbox_info``)."""
    with _DESCRIBED_LOCK:
        return [dict(d) for d in _DESCRIBED.values()]


STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_TIMEOUT = "timeout"
STATUS_MEMORY = "memory"
STATUS_OUTPUT_LIMIT = "output_limit"
STATUS_TOO_MANY_PROCESSES = "too_many_processes"
STATUS_SIGNAL = "signal"

_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_FORK_FAILED_RE = re.compile(r"BlockingIOError: \[Errno 11\]|Resource temporarily unavailable")
_SETUP_FAILED = "ludic-sandbox: setup failed"


@dataclass(frozen=True)
class ExecResult:
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def reason(self) -> str:
        if self.status == STATUS_ERROR:
            return f"runtime_error: {self.detail}"
        if self.status == STATUS_TOO_MANY_PROCESSES:
            return "killed: too many processes"
        if self.status == STATUS_SIGNAL:
            return f"killed: {self.detail}"
        return self.status


class Sandbox(Protocol):
    def run(
        self, source: str, *, stdin: str = "", timeout_s: float = 5.0, memory_limit_mb: int = 256
    ) -> ExecResult: ...


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run, as rlimit values (soft, hard)."""

    cpu_s: tuple[int, int]
    as_bytes: int
    fsize_bytes: int
    nproc: int
    nofile: int = 256

    @classmethod
    def make(
        cls, *, timeout_s: float, memory_limit_mb: int, max_file_bytes: int, max_processes: int
    ) -> Limits:
        cpu = int(math.ceil(timeout_s)) + 1
        return cls(
            cpu_s=(cpu, cpu + 1),
            as_bytes=int(memory_limit_mb) * 1024 * 1024,
            fsize_bytes=int(max_file_bytes),
            nproc=int(max_processes),
        )

    def rlimits(self, nproc: int | None = None) -> list[tuple[int, tuple[int, int]]]:
        n = self.nproc if nproc is None else nproc
        return [
            (resource.RLIMIT_CPU, self.cpu_s),
            (resource.RLIMIT_AS, (self.as_bytes, self.as_bytes)),
            (resource.RLIMIT_FSIZE, (self.fsize_bytes, self.fsize_bytes)),
            (resource.RLIMIT_NPROC, (n, n)),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NOFILE, (self.nofile, self.nofile)),
        ]

    def prlimit_args(self) -> list[str]:
        return [
            f"--cpu={self.cpu_s[0]}:{self.cpu_s[1]}",
            f"--as={self.as_bytes}",
            f"--fsize={self.fsize_bytes}",
            f"--nproc={self.nproc}",
            "--core=0",
            f"--nofile={self.nofile}",
        ]


# Runs as root inside fresh mount/pid/net namespaces, then drops to the run's uid.
# $1 run dir, $2 uid, $3 gid, $4 tmpfs size in bytes; the rest is the Python command.
_NAMESPACE_SCRIPT = r"""
w=$1; u=$2; g=$3; sz=$4; shift 4
fail() { echo "ludic-sandbox: setup failed: $1" >&2; exit 125; }
mount -t tmpfs -o "size=$sz,nr_inodes=4096,mode=0700,uid=$u,gid=$g,nosuid,nodev" \
  ludic-sandbox "$w/run" || fail "tmpfs mount on $w/run"
while read -r _ mp fs opts _; do
  case "$mp:$fs:$opts" in
    "$w/run":*|*:*:ro,*|*:proc:*|*:sysfs:*|*:cgroup:*|*:cgroup2:*|*:devpts:*) ;;
    *) mount -o remount,bind,ro "$mp" 2>/dev/null || : ;;
  esac
done < /proc/self/mounts
cd "$w/run" || fail "cd $w/run"
setpriv --reuid="$u" --regid="$g" --clear-groups --no-new-privs -- "$@"
"""


def namespace_command(
    *,
    python: str,
    workdir: str,
    uid: int,
    gid: int,
    limits: Limits,
    tmpfs_bytes: int,
    block_network: bool = False,
) -> list[str]:
    """argv of a namespace-mode run (host euid 0 with util-linux ``prlimit``/``unshare``/
    ``setpriv``/``mount``). Exit status: the code's, or 128+N when it died of signal N (the
    script does not ``exec`` so it can report it).

    The command: ``setpriv --pdeathsig KILL -- prlimit ... -- unshare --net --mount --pid
    --fork --kill-child --mount-proc -- sh -c`` with a setup script that mounts a
    size-capped tmpfs as the writable cwd, remounts every other mount read-only
    (``remount,bind,ro``: per-mount flags inside the private mount namespace only, the
    host's mounts are untouched), then ``setpriv`` drops to a fresh random uid (one per run,
    from ``uid_range``, no groups, no capabilities, ``no_new_privs``) and runs Python. So:
    no network (empty netns: only a down loopback); writes outside the cwd fail with
    EROFS/EACCES; RLIMIT_NPROC is exact because the uid is the run's own (as root
    RLIMIT_NPROC is not enforced, which is why we never run the code as root); every process
    is killed by the kernel when the pid namespace's init dies, including ones that
    ``setsid``/double-fork away, and the parent-death signal kills the whole tree if the
    host process dies mid-run; the code cannot see host processes.
    """
    return [
        # SIGKILL the tree's root if the thread that started it dies (host crash): unshare's
        # --kill-child then kills the pid namespace's init and the kernel the rest.
        "setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        "prlimit",
        *limits.prlimit_args(),
        "--",
        "unshare",
        "--net",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        _NAMESPACE_SCRIPT,
        "ludic-sandbox",
        workdir,
        str(uid),
        str(gid),
        str(tmpfs_bytes),
        *python_argv(python, os.path.join(workdir, "main.py"), block_network),
    ]


# ---------------------------------------------------------------------------------------
# /proc helpers: the sweep and the watchdog


def _proc_pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    uid: int  # real uid: what RLIMIT_NPROC counts
    state: str  # "R", "S", "Z" (zombie), ...
    rss_bytes: int


def _proc_info(pid: int) -> ProcInfo | None:
    # /proc/<pid>/status, not the dir owner: a process that made itself non-dumpable shows
    # as root-owned in /proc but its status still names its real uid.
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return None
    uid, state, rss = None, "?", 0
    for line in data.splitlines():
        if line.startswith(b"State:"):
            state = line.split()[1].decode()
        elif line.startswith(b"Uid:"):
            uid = int(line.split()[1])
        elif line.startswith(b"VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return None if uid is None else ProcInfo(pid, uid, state, rss)


def _session_id(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def procs_of_uid(uid: int) -> list[ProcInfo]:
    """Processes whose real uid is ``uid``, zombies included (they still count against
    RLIMIT_NPROC until reaped)."""
    out = []
    for p in _proc_pids():
        info = _proc_info(p)
        if info is not None and info.uid == uid:
            out.append(info)
    return out


def procs_in_session(sid: int) -> list[ProcInfo]:
    out = []
    for p in _proc_pids():
        if _session_id(p) == sid:
            info = _proc_info(p)
            if info is not None:
                out.append(info)
    return out


def pids_of_uid(uid: int, *, live_only: bool = False) -> list[int]:
    return [i.pid for i in procs_of_uid(uid) if not (live_only and i.state in ("Z", "X"))]


def pids_in_session(sid: int) -> list[int]:
    return [i.pid for i in procs_in_session(sid)]


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_UID_LOCK = threading.Lock()
_UIDS_IN_USE: set[int] = set()


def _lease_uid(lo: int, hi: int) -> int:
    # Random in a wide range so independent host processes practically never collide; a
    # set guards against collisions inside this process.
    rng = random.SystemRandom()
    with _UID_LOCK:
        for _ in range(1000):
            uid = rng.randrange(lo, hi)
            if uid not in _UIDS_IN_USE:
                _UIDS_IN_USE.add(uid)
                return uid
    raise RuntimeError(f"no free sandbox uid in [{lo}, {hi}); widen SubprocessSandbox.uid_range")


def _release_uid(uid: int) -> None:
    with _UID_LOCK:
        _UIDS_IN_USE.discard(uid)


def _world_executable(path: str) -> bool:
    """True if a user with no relation to the file's owner can exec ``path``."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        d = os.path.dirname(real)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(d)
            if parent == d:
                return True
            d = parent
    except OSError:
        return False


def _rmtree(path: str) -> None:
    def _onerror(func: Callable[[str], object], p: str, _exc: object) -> None:
        # The code may chmod 000 its own dirs; make them writable and retry once.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=_onerror)


# ---------------------------------------------------------------------------------------
# the I/O pump shared with the Docker backend


def pump(
    proc: subprocess.Popen[bytes],
    *,
    deadline: float,
    max_output_bytes: int,
    tick: Callable[[], str | None] | None = None,
    on_exit: Callable[[], None] | None = None,
    exit_grace_s: float = 1.0,
) -> tuple[bytes, bytes, str | None]:
    """Read stdout/stderr until both close and the process exits.

    Returns (stdout, stderr, stop) where stop is None (finished), ``"timeout"``,
    ``"output_limit"`` or whatever ``tick()`` returned (it is called about every 0.1 s; a
    non-None value stops the run). ``on_exit`` runs once when the main process exits, to
    kill descendants that still hold the pipes.
    """
    assert proc.stdout is not None and proc.stderr is not None
    bufs: dict[int, bytearray] = {
        proc.stdout.fileno(): bytearray(),
        proc.stderr.fileno(): bytearray(),
    }
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    exited_at: float | None = None
    next_tick = time.monotonic() + 0.1
    stop: str | None = None
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
                if on_exit is not None:
                    on_exit()
            if exited_at is not None and (not sel.get_map() or now - exited_at > exit_grace_s):
                break
            if now >= deadline:
                stop = STATUS_TIMEOUT
                break
            if tick is not None and now >= next_tick:
                next_tick = now + 0.1
                stop = tick()
                if stop is not None:
                    break
            wait = max(0.0, min(0.05, deadline - now))
            if not sel.get_map():
                time.sleep(min(wait, 0.005))
                continue
            for key, _ in sel.select(wait):
                fd = int(key.fd)
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    continue
                bufs[fd] += data
                if len(bufs[fd]) > max_output_bytes:
                    stop = STATUS_OUTPUT_LIMIT
            if stop is not None:
                break
    finally:
        sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), stop


def _decode(b: bytes, cap: int) -> str:
    return b[:cap].decode("utf-8", errors="replace")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def classify(
    *,
    returncode: int | None,
    stop: str | None,
    stderr: str,
    signal_from_exit_code: bool,
) -> tuple[str, str]:
    """(status, detail) of a finished run; see ``ExecResult``."""
    fork_failed = bool(_FORK_FAILED_RE.search(stderr))
    if stop == STATUS_TIMEOUT:
        return (STATUS_TOO_MANY_PROCESSES, "fork failed") if fork_failed else (STATUS_TIMEOUT, "")
    if stop is not None:
        return stop, ""
    if returncode is None:
        return STATUS_ERROR, "no exit status"
    sig: int | None = None
    if returncode < 0:
        sig = -returncode
    elif signal_from_exit_code and returncode > 128:
        sig = returncode - 128
    if sig is not None:
        if sig == signal.SIGXCPU:
            return STATUS_TIMEOUT, "cpu time limit"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return STATUS_SIGNAL, name
    if returncode == 0:
        return STATUS_OK, ""
    last = _last_line(stderr)
    if _SETUP_FAILED in stderr:
        return STATUS_ERROR, last
    if last.startswith("MemoryError") or last.endswith("MemoryError"):
        return STATUS_MEMORY, last
    if fork_failed:
        return STATUS_TOO_MANY_PROCESSES, last
    return STATUS_ERROR, last or f"exit code {returncode}"


# ---------------------------------------------------------------------------------------


# what every run must ensure, and how (a missing one refuses to run unless allowed)
GUARANTEES = {
    "network_isolated": "the code cannot open a socket (the seccomp socket filter holds)",
    "environment_private": "the code cannot read the environment (/proc/<pid>/environ) of "
    "the host process or of any other process of the run: it runs as another uid, or, as "
    "the host's uid, inside a Landlock domain (which scopes such access to its own "
    "processes) beside a non-dumpable host (every ludic service makes itself so)",
    "filesystem_read_only_outside_cwd": "the code cannot write outside its run dir "
    "(namespace mode: read-only remounts; plain mode: Landlock, checked by a probe run)",
}
PR_GET_DUMPABLE = 3


def host_dumpable() -> bool:
    """Whether this process is dumpable (its /proc files readable by its own uid's
    processes); True where prctl is unavailable (assume the worst)."""
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0)
    except (OSError, AttributeError):
        return True


@dataclass(frozen=True)
class _Plan:
    mode: str  # "namespace" | "plain"
    python: str
    drop_uid: bool
    note: str = ""
    block_network: bool = False  # plain mode: the seccomp socket filter (namespace: netns)
    # runs as another uid, or in a Landlock domain beside a non-dumpable host
    environment_private: bool = True
    confine_writes: bool = False  # plain mode: Landlock (namespace: read-only remounts)


@dataclass
class SubprocessSandbox:
    """The subprocess sandbox of the module docstring (its contract and guarantees).

    Every run, whatever the isolation mode:

    - a fresh temp dir (``mkdtemp``), removed in ``finally``; the code is ``main.py`` in it and
      runs as ``python -I`` (isolated: no env vars, no user site, no cwd on sys.path);
    - a scrubbed environment (PATH, HOME=TMPDIR=the run dir, C.UTF-8 locale);
    - rlimits: RLIMIT_CPU = ceil(timeout)+1 s (SIGXCPU, hard +1 s -> SIGKILL), RLIMIT_AS =
      memory_limit_mb, RLIMIT_FSIZE = ``max_file_bytes``, RLIMIT_NPROC = ``max_processes``,
      RLIMIT_CORE = 0, RLIMIT_NOFILE = 256;
    - a new session (``setsid``); on wall-clock timeout, on output overflow, and as soon as the
      main process exits, the whole process group is SIGKILLed and the run's uid (or session)
      is swept in /proc, so a child that sleeps forever does not survive the run;
    - stdout and stderr are read concurrently and each capped at ``max_output_bytes``; going
      past the cap kills the run (``output_limit``), so printing gigabytes costs the host at
      most 2 x cap bytes of memory;
    - a watchdog (every 0.1 s) kills the run when its processes reach ``max_processes`` or
      their summed RSS exceeds ``memory_limit_mb`` (RLIMIT_AS is per process, so without it
      ``max_processes`` children could use ``max_processes`` x the limit; the 0.1 s sampling
      lets a burst overshoot briefly).

    Plain mode (any other host; the namespace mode: :func:`namespace_command`):
    ``python -I`` with rlimits set in ``preexec_fn``; when the host is root the child also
    drops to a fresh random uid (``Popen(user=, group=, extra_groups=[])``) and the run dir is
    chowned to it. The code runs inside a Landlock domain (``landlock.py``; a probe run
    checks it holds): it can write only beneath its run dir, cannot read the environment of
    (ptrace) any process outside the domain and, from Landlock ABI 6, cannot signal one. As
    a non-root host the code runs as the host's uid: the host must also be non-dumpable
    (every ludic service makes itself so, ``services/common/secrets.py``). Without Landlock
    (an older kernel, the LSM off, a container runtime's seccomp profile refusing its
    syscalls) the code could write to world-writable dirs (/tmp, /dev/shm) and, as the
    host's uid, read the environment of the run's other processes (vLLM's engine, torchrun's
    agent): the sandbox refuses, naming Landlock, unless ``allow`` names
    ``filesystem_read_only_outside_cwd`` (and, without root, ``environment_private``).

    Gaps, documented not hidden: as a non-root host RLIMIT_NPROC counts all of the host
    user's processes (we set it to current + ``max_processes``) and a child that ``setsid``s
    into a new session escapes the sweep; if the host process dies mid-run only the main
    child gets the parent-death SIGKILL, not its own children; ``preexec_fn`` is not safe
    with threads that hold locks at fork time (the namespace mode does not use it).
    """

    isolation: str = "auto"  # "auto" | "namespace" | "plain"
    python: str | None = None  # interpreter for the code (None: pick one the uid can run)
    max_processes: int = 16  # RLIMIT_NPROC and watchdog cap (tasks incl. the main one)
    max_output_bytes: int = 1 << 20  # per stream
    max_file_bytes: int = 1 << 20  # RLIMIT_FSIZE
    tmpfs_bytes: int = 16 << 20  # namespace mode: size of the writable cwd
    uid_range: tuple[int, int] = (1_100_000, 2_100_000)  # fresh uid per run when host is root
    # Parent of the run dirs (None: system temp dir); must be traversable by others when
    # the host is root, since the code runs as a fresh uid.
    work_root: str | None = None
    # GUARANTEES this sandbox may run without (each named on purpose; default: none)
    allow: tuple[str, ...] = ()
    _plan_cache: _Plan | None = field(default=None, init=False, repr=False)
    _plan_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", "namespace", "plain"):
            raise ValueError(
                f"SubprocessSandbox.isolation={self.isolation!r}; use 'auto', 'namespace' or "
                f"'plain'"
            )
        if self.max_processes < 2:
            raise ValueError(f"SubprocessSandbox.max_processes={self.max_processes} must be >= 2")
        if self.max_output_bytes < 1 or self.max_file_bytes < 1 or self.tmpfs_bytes < 1 << 20:
            raise ValueError(
                "SubprocessSandbox byte caps must be positive and tmpfs_bytes >= 1 MiB; got "
                f"max_output_bytes={self.max_output_bytes} max_file_bytes={self.max_file_bytes} "
                f"tmpfs_bytes={self.tmpfs_bytes}"
            )
        unknown = sorted(set(self.allow) - set(GUARANTEES))
        if unknown:
            raise ValueError(
                f"SubprocessSandbox.allow names unknown guarantee(s) {unknown}; known: "
                f"{sorted(GUARANTEES)}"
            )
        lo, hi = self.uid_range
        if not 1000 <= lo < hi <= 2**31:
            raise ValueError(
                f"SubprocessSandbox.uid_range={self.uid_range} must satisfy 1000 <= lo < hi <= 2**31"
            )

    # -- mode selection -----------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._plan().mode

    def describe(self) -> dict[str, object]:
        """What this sandbox enforces on this host (for logs and run metadata)."""
        return self._describe(self._plan())

    def _describe(self, p: _Plan) -> dict[str, object]:
        return {
            "mode": p.mode,
            "python": p.python,
            "runs_as_fresh_uid": p.drop_uid,
            "network_isolated": p.block_network,
            "environment_private": p.environment_private,
            "filesystem_read_only_outside_cwd": p.mode == "namespace" or p.confine_writes,
            "allowed_without": sorted(self.allow),
            "note": p.note,
        }

    def _pick_python(self, need_world: bool) -> str:
        cands = (
            [self.python]
            if self.python
            else [sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]
        )
        for c in cands:
            if c and os.path.exists(c) and (not need_world or _world_executable(c)):
                return c
        raise RuntimeError(
            f"SubprocessSandbox found no Python interpreter that an unprivileged uid can run "
            f"among {cands}; install a system python3 or set SubprocessSandbox(python=...)"
        )

    def _plan(self) -> _Plan:
        with self._plan_lock:
            if self._plan_cache is None:
                plan = self._resolve()
                held = {
                    "network_isolated": plan.block_network,
                    "environment_private": plan.environment_private,
                    "filesystem_read_only_outside_cwd": plan.mode == "namespace"
                    or plan.confine_writes,
                }
                missing = [g for g, ok in held.items() if not ok and g not in self.allow]
                if missing:
                    raise RuntimeError(
                        f"SubprocessSandbox ({plan.mode} mode) cannot guarantee "
                        + "; ".join(f"{g}: {GUARANTEES[g]}" for g in missing)
                        + (f" ({plan.note})" if plan.note else "")
                        + f". Refusing to run untrusted code; to run anyway, allow it: "
                        f"SubprocessSandbox(allow={tuple(missing)!r}) or "
                        f"LUDIC_SANDBOX_ALLOW={','.join(missing)}"
                    )
                self._plan_cache = plan
                desc = self._describe(plan)
                log.info("code sandbox: %s", desc)
                with _DESCRIBED_LOCK:
                    _DESCRIBED[id(self)] = desc
            return self._plan_cache

    def _resolve(self) -> _Plan:
        root = os.geteuid() == 0
        if self.isolation in ("auto", "namespace"):
            missing = [t for t in ("prlimit", "unshare", "setpriv", "mount") if not shutil.which(t)]
            why = ""
            if not root:
                why = "namespace isolation needs a root host process"
            elif missing:
                why = f"missing tools {missing} (util-linux)"
            else:
                plan = _Plan("namespace", self._pick_python(True), True)
                probe = self._run(plan, "print(6 * 7)", "", 10.0, 256)
                if probe.ok and probe.stdout.strip() == "42":
                    return self._with_socket_filter(plan)
                why = f"probe failed: {probe.reason} {probe.stderr[-300:]!r}"
            if self.isolation == "namespace":
                raise RuntimeError(f"SubprocessSandbox(isolation='namespace') unavailable: {why}")
            note = f"namespace mode unavailable ({why})"
        else:
            note = "plain mode requested"
        plain = self._with_write_confinement(_Plan("plain", self._pick_python(root), root, note))
        # A fresh uid keeps every process of the run private. As the host's uid, a
        # non-dumpable host keeps only itself private; its siblings of that uid (vLLM's
        # engine, torchrun's agent) stay readable unless the code runs in a Landlock domain,
        # which denies ptrace access (/proc/<pid>/environ) to any process outside it.
        private = root or (plain.confine_writes and not host_dumpable())
        return self._with_socket_filter(replace(plain, environment_private=private))

    def _with_write_confinement(self, plan: _Plan) -> _Plan:
        """``plan`` confining the code's writes to its directory when Landlock is there and a
        probe run shows it holds (``landlock.py``), else ``plan`` with a note."""
        if landlock.abi_version() < 1:
            why = "no Landlock in this kernel"
        else:
            confined = replace(plan, confine_writes=True)
            probe = self._run(confined, landlock.WRITE_PROBE, "", 10.0, 256)
            if probe.ok and probe.stdout.strip() == "confined":
                return confined
            why = f"Landlock did not hold: {probe.reason} {probe.stdout[-200:]!r} {probe.stderr[-300:]!r}"
        sep = "; " if plan.note else ""
        return replace(plan, note=f"{plan.note}{sep}writes outside the run dir possible ({why})")

    def _with_socket_filter(self, plan: _Plan) -> _Plan:
        """``plan`` with the socket filter when a probe run shows it holds (``seccomp.py``,
        module docstring), else ``plan`` with a note that the network is reachable."""
        if socket_filter_code() is None:
            why = f"no seccomp filter for {platform.machine()}"
        else:
            blocked = replace(plan, block_network=True)
            probe = self._run(blocked, NETWORK_PROBE, "", 10.0, 256)
            if probe.ok and probe.stdout.strip() == "blocked":
                return blocked
            why = f"the seccomp filter did not hold: {probe.reason} {probe.stderr[-300:]!r}"
        sep = "; " if plan.note else ""
        return replace(plan, note=f"{plan.note}{sep}network reachable ({why})")

    # -- one run ------------------------------------------------------------------------

    def run(
        self, source: str, *, stdin: str = "", timeout_s: float = 5.0, memory_limit_mb: int = 256
    ) -> ExecResult:
        return self._run(self._plan(), source, stdin, timeout_s, memory_limit_mb)

    def _run(
        self, plan: _Plan, source: str, stdin: str, timeout_s: float, memory_limit_mb: int
    ) -> ExecResult:
        limits = Limits.make(
            timeout_s=timeout_s,
            memory_limit_mb=memory_limit_mb,
            max_file_bytes=self.max_file_bytes,
            max_processes=self.max_processes,
        )
        uid = _lease_uid(*self.uid_range) if plan.drop_uid else None
        workdir = tempfile.mkdtemp(prefix="ludic-sbx-", dir=self.work_root)
        proc: subprocess.Popen[bytes] | None = None
        t0 = time.monotonic()
        try:
            main = os.path.join(workdir, "main.py")
            with open(main, "w", encoding="utf-8") as f:
                f.write(source)
            os.chmod(main, 0o644)
            env = {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
            kwargs: dict[str, object] = {}
            if plan.mode == "namespace":
                assert uid is not None
                os.chmod(workdir, 0o755)
                os.mkdir(os.path.join(workdir, "run"), 0o700)
                argv = namespace_command(
                    python=plan.python,
                    workdir=workdir,
                    uid=uid,
                    gid=uid,
                    limits=limits,
                    tmpfs_bytes=self.tmpfs_bytes,
                    block_network=plan.block_network,
                )
                home = os.path.join(workdir, "run")
            else:
                argv = python_argv(plan.python, main, plan.block_network, plan.confine_writes)
                home = workdir
                nproc = limits.nproc
                if uid is not None:
                    os.chown(workdir, uid, uid)
                    os.chown(main, uid, uid)
                    kwargs.update(user=uid, group=uid, extra_groups=[])
                else:
                    # Non-root: RLIMIT_NPROC counts every process of this user.
                    nproc = len(pids_of_uid(os.getuid())) + limits.nproc
                    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
                    if hard != resource.RLIM_INFINITY:
                        nproc = min(nproc, hard)
                kwargs["preexec_fn"] = _make_preexec(limits.rlimits(nproc))
            env.update(HOME=home, TMPDIR=home)

            def sweep() -> None:
                _kill_group(proc)
                if uid is not None:
                    for _ in range(50):
                        left = pids_of_uid(uid, live_only=True)
                        if not left:
                            break
                        _kill_pids(left)
                        time.sleep(0.01)
                elif proc is not None:
                    _kill_pids([p for p in pids_in_session(proc.pid) if p != os.getpid()])

            def watchdog() -> str | None:
                # RLIMIT_AS caps each process; this caps their sum (n x memory otherwise).
                if uid is not None:
                    procs = procs_of_uid(uid)
                else:
                    procs = procs_in_session(proc.pid) if proc is not None else []
                if len(procs) >= limits.nproc:
                    return STATUS_TOO_MANY_PROCESSES
                if sum(i.rss_bytes for i in procs) > limits.as_bytes:
                    return STATUS_MEMORY
                return None

            with tempfile.TemporaryFile() as fin:
                fin.write(stdin.encode("utf-8"))
                fin.seek(0)
                proc = subprocess.Popen(  # type: ignore[call-overload]
                    argv,
                    stdin=fin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=workdir,
                    env=env,
                    start_new_session=True,
                    **kwargs,
                )
            out, err, stop = pump(
                proc,
                deadline=t0 + timeout_s,
                max_output_bytes=self.max_output_bytes,
                tick=watchdog,
                on_exit=sweep,
            )
            sweep()
            rc = proc.wait()
            stderr = _decode(err, self.max_output_bytes)
            status, detail = classify(
                returncode=None if stop else rc,
                stop=stop,
                stderr=stderr,
                signal_from_exit_code=plan.mode == "namespace",
            )
            return ExecResult(
                status=status,
                returncode=rc,
                stdout=_decode(out, self.max_output_bytes),
                stderr=stderr,
                duration_s=time.monotonic() - t0,
                detail=detail,
            )
        finally:
            if proc is not None:
                _kill_group(proc)
                if uid is not None:
                    _kill_pids(pids_of_uid(uid, live_only=True))
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # pragma: no cover - D-state process
                    pass
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            _rmtree(workdir)
            if uid is not None:
                _release_uid(uid)


def _kill_group(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session
    except (ProcessLookupError, PermissionError):
        pass


_PR_SET_PDEATHSIG = 1


def _make_preexec(rlimits: list[tuple[int, tuple[int, int]]]) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)  # resolved here, not in the forked child
    prctl = libc.prctl

    def _preexec() -> None:  # runs in the child between fork and exec, after the uid drop
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        for res, value in rlimits:
            resource.setrlimit(res, value)

    return _preexec
