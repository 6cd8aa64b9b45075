"""A stop signal of `ludic up` is never swallowed: its Interrupted is a BaseException, so
code on the way that catches Exception lets it through; and it is remembered, so the
monitor loop stops even if something caught it anyway."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.launcher import worker


def test_a_stop_signal_goes_through_except_exception_and_is_remembered() -> None:
    old = signal.signal(signal.SIGTERM, worker._on_signal)
    worker._STOP.clear()
    try:
        with pytest.raises(worker.Interrupted, match="SIGTERM"):
            try:  # code on the way that catches errors
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except Exception:
                pytest.fail("the stop was caught as an Exception")
        assert worker._STOP == ["SIGTERM"]
    finally:
        signal.signal(signal.SIGTERM, old)
        worker._STOP.clear()
