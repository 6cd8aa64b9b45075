"""The shared service skeleton: exit codes and cleanup of service_main."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common.lifecycle import StartupAborted, abort_on_stop_signals
from services.common.skeleton import service_main

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Settings:
    mode: str = field(default="ok", metadata={"help": "ok | fatal | bug"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})


class Fatal(RuntimeError):
    pass


async def run(s: Settings, *, stop: asyncio.Event) -> str:
    if s.mode == "fatal":
        raise Fatal("too many failures")
    if s.mode == "bug":
        raise KeyError("bug")
    return "done"


def test_exit_codes_and_cleanup(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("LUDIC_MODE", "LUDIC_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    calls: list[str] = []
    kw = dict(
        description="t",
        fatal=(Fatal,),
        cleanup=lambda: calls.append("cleanup"),
        finished=calls.append,
    )
    assert service_main("t", Settings, run, ["--mode", "ok"], **kw) == 0  # type: ignore[arg-type]
    assert calls == ["done", "cleanup"]
    assert service_main("t", Settings, run, ["--mode", "fatal"], **kw) == 1  # type: ignore[arg-type]
    assert calls[-1] == "cleanup"
    with pytest.raises(KeyError):  # anything else is a crash, with its traceback
        service_main("t", Settings, run, ["--mode", "bug"], **kw)  # type: ignore[arg-type]
    assert calls.count("cleanup") == 3


@dataclass
class Checked:
    workers: int = field(default=1, metadata={"help": "> 0"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers} must be >= 1; pass --workers N")


async def report(s: Checked, *, stop: asyncio.Event) -> int:
    return s.workers


def test_bad_settings_exit_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for k in ("LUDIC_WORKERS", "LUDIC_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    for argv, needle in [
        (["--workers", "0"], "workers=0 must be >= 1"),
        (["--workers", "two"], "cannot read 'two'"),
        (["--config", "/no/such.yaml"], "/no/such.yaml does not exist"),
    ]:
        assert service_main("t", Checked, report, argv, description="t") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ludic t: ") and needle in err[0], err


def test_argv_defaults_to_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LUDIC_WORKERS", raising=False)
    seen: list[object] = []
    kw = dict(description="t", finished=seen.append)
    assert service_main("t", Checked, report, ["--workers", "3"], **kw) == 0  # type: ignore[arg-type]
    monkeypatch.setattr(sys, "argv", ["prog", "--workers", "4"])  # python -m services.X.main
    assert service_main("t", Checked, report, None, **kw) == 0  # type: ignore[arg-type]
    assert seen == [3, 4]


BLOCKING_START = """
import asyncio, sys, time
from dataclasses import dataclass
from services.common.lifecycle import StartupAborted, abort_on_stop_signals
from services.common.skeleton import service_main

@dataclass
class S:
    log_level: str = "INFO"

async def run(s, *, stop):
    with abort_on_stop_signals():
        print("starting", flush=True)
        try:
            time.sleep(60)  # blocks the event loop, as vLLM's engine start does
        except KeyboardInterrupt:  # and swallows a KeyboardInterrupt, as vLLM 0.32 does
            pass
    print("started", flush=True)
    await stop.wait()

sys.exit(service_main("t", S, run, [], description="t"))
"""


def test_a_stop_signal_aborts_a_start_up_that_blocks_the_event_loop() -> None:
    """Without the abort, SIGTERM would only be seen after the 60 s block ("started" printed);
    a KeyboardInterrupt-based abort would be swallowed by the block (as vLLM's would)."""
    p = subprocess.Popen(
        [sys.executable, "-c", BLOCKING_START],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "starting"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "started" not in out and "t stopped during start-up" in err


def test_abort_on_stop_signals_restores_the_handlers() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(StartupAborted, match="SIGTERM"):
        with abort_on_stop_signals():
            signal.raise_signal(signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in before} == before


async def test_a_stopping_process_does_not_wait_for_redis(monkeypatch) -> None:
    """After a stop signal (stop_retrying) retry_redis re-raises at once instead of backing
    off: a service stopping because `ludic up` died must not wait for a Redis that is gone."""
    import redis.exceptions as rexc

    from libludic import transport
    from libludic.transport import connection

    monkeypatch.setattr(connection, "_stopping", False)
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise rexc.ConnectionError("gone")

    task = asyncio.create_task(transport.retry_redis(down))
    await asyncio.sleep(0.3)
    assert not task.done() and calls >= 1  # backing off, retrying
    transport.stop_retrying()
    with pytest.raises(rexc.ConnectionError):
        await asyncio.wait_for(task, 10)


CHILD_ENV = """
import subprocess, sys
from dataclasses import dataclass, field
from services.common.skeleton import service_main

@dataclass
class S:
    log_level: str = "INFO"
    redis_url: str = ""
    auth_token: str | None = field(default=None, repr=False)

async def run(s, *, stop):
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(k for k in os.environ if 'LUDIC' in k or 'REDIS' in k))"],
        capture_output=True, text=True, check=True,
    )
    print("settings", bool(s.auth_token), s.redis_url.startswith("redis://:pw@"), flush=True)
    print("child", child.stdout.strip(), flush=True)

sys.exit(service_main("t", S, run, [], description="t"))
"""


def test_a_service_keeps_its_secrets_and_no_child_inherits_them() -> None:
    """The settings hold the token and the Redis URL (with its password); once read, they
    leave the process's environment, so a child it starts (vLLM's engine, a tool) has none."""
    env = {
        **os.environ,
        "LUDIC_AUTH_TOKEN": "tok",
        "LUDIC_API_KEY": "key",
        "LUDIC_REDIS_URL": "redis://:pw@127.0.0.1:6379/0",
        "REDISCLI_AUTH": "pw",
        "LUDIC_LOG_LEVEL": "INFO",
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD_ENV],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "settings True True" in out.stdout
    child = out.stdout.split("child ", 1)[1].strip()
    seen = set(ast.literal_eval(child))
    assert "LUDIC_LOG_LEVEL" in seen, child  # other variables pass as they were
    assert not seen & {"LUDIC_AUTH_TOKEN", "LUDIC_API_KEY", "LUDIC_REDIS_URL", "REDISCLI_AUTH"}
