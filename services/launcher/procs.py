"""The processes of a run, read from /proc (Linux): how the soak (scripts/soak.py) and the
tests of ``ludic up`` find what a run started. Every service ``ludic up`` starts carries the
run's ``LUDIC_RUN_ID`` in its environment; reading another process's environment needs its
uid or root (the services make themselves non-dumpable: then root only).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    argv: tuple[bytes, ...]
    environ: bytes  # NUL-separated KEY=VALUE, b"" where unreadable

    @property
    def name(self) -> str:
        """``ludic <service>``'s service name, else the program's name (redis-server
        rewrites its title: argv[0] becomes "/usr/bin/redis-server host:port")."""
        argv = [a.decode(errors="replace") for a in self.argv]
        if "services.cli" in argv and argv.index("services.cli") + 1 < len(argv):
            return argv[argv.index("services.cli") + 1]
        return Path(argv[0].split(" ")[0]).name if argv else ""

    def env_has(self, key: str, value: str) -> bool:
        return f"{key}={value}".encode() in self.environ.split(b"\0")


def processes() -> Iterator[Proc]:
    """Every process this one can read (those that exit meanwhile are skipped)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = tuple((d / "cmdline").read_bytes().rstrip(b"\0").split(b"\0"))
        except (OSError, ValueError, IndexError):
            continue
        try:
            environ = (d / "environ").read_bytes()
        except OSError:
            environ = b""
        yield Proc(int(d.name), ppid, argv, environ)


def of_run(run_id: str) -> list[Proc]:
    """The processes whose environment carries ``LUDIC_RUN_ID=run_id``."""
    return [p for p in processes() if p.env_has("LUDIC_RUN_ID", run_id)]


def children(parent: int) -> list[Proc]:
    return [p for p in processes() if p.ppid == parent]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid``; None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
