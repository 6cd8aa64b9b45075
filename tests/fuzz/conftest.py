"""The fuzz tier's summary table: each test adds rows (stream or route, sent, dead-lettered
or refused, processed, crashes) to ``fuzz_summary``; pytest prints them at the end."""

from __future__ import annotations

import os

import pytest

ROWS = pytest.StashKey[list[tuple[str, int, int, int, int]]]()
#: hostile entries per stream / bodies per route, and the seed (printed in the summary)
FUZZ_N = int(os.environ.get("LUDIC_FUZZ_N", "200"))
FUZZ_SEED = int(os.environ.get("LUDIC_FUZZ_SEED", "0"))


@pytest.fixture
def fuzz_summary(request: pytest.FixtureRequest) -> list[tuple[str, int, int, int, int]]:
    return request.config.stash.setdefault(ROWS, [])


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    rows = config.stash.get(ROWS, [])
    if not rows:
        return
    tr = terminalreporter
    tr.section(f"fuzz summary (LUDIC_FUZZ_SEED={FUZZ_SEED}, LUDIC_FUZZ_N={FUZZ_N})")
    tr.write_line(
        f"{'stream / route':<34} {'sent':>6} {'refused':>8} {'processed':>10} {'crashes':>8}"
    )
    for name, sent, refused, processed, crashes in rows:
        tr.write_line(f"{name:<34} {sent:>6} {refused:>8} {processed:>10} {crashes:>8}")
    tr.write_line("refused: dead-lettered (streams) or answered 4xx (routes)")
