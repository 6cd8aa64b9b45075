"""The shared service skeleton: exit codes and cleanup of service_main."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.common.skeleton import service_main


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
    kw = dict(description="t", fatal=(Fatal,), cleanup=lambda: calls.append("cleanup"),
              finished=calls.append)
    assert service_main("t", Settings, run, ["--mode", "ok"], **kw) == 0  # type: ignore[arg-type]
    assert calls == ["done", "cleanup"]
    assert service_main("t", Settings, run, ["--mode", "fatal"], **kw) == 1  # type: ignore[arg-type]
    assert calls[-1] == "cleanup"
    with pytest.raises(KeyError):  # anything else is a crash, with its traceback
        service_main("t", Settings, run, ["--mode", "bug"], **kw)  # type: ignore[arg-type]
    assert calls.count("cleanup") == 3
