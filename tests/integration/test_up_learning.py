"""A multi-turn task learns through the services, measured the way the README reports it.

`ludic up --config examples/tic_tac_toe/grpo.yaml` as shipped (the tiny model built, its
warm start on legal play, GRPO against the heuristic opponent, up to 5 model calls a game)
with a smaller RL budget given the way a user gives it (``LUDIC_NUM_STEPS``, flags), against
the real services. The held-out evaluation (200 games on env seeds no training game uses,
greedy, before and after) must gain beyond its noise: more than twice the standard error of
the difference of two binomial proportions over n games,
``sqrt(p0 (1 - p0) / n + p1 (1 - p1) / n)`` (about 0.05 at these rates, so a gain of
about 10 points), with illegal moves at most 2% at the end.

The README's table is the full budget (500 steps) over 3 seeds: +34.5 to +43.5 points. The
gain at a given step varies from run to run (the services are asynchronous, so even one
seed's runs differ): at 100 steps two runs of this test gained +23.0 and +13.0 and the
table's curves +16.0, +30.5 and +15.5, too close to the margin (about 10 points) for a test
that must not flake; at 200 steps the curves gained +22.5, +33.5 and +34.0 (an earlier
run without feeder.seed_base: +13.5). This test runs seed 1's configuration for 200 steps,
514 s here (+35.0 points), about a third of it the warm start, with the shipped evaluation
(k: 4 sampled games a seed); the test evaluates greedy only.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "tic_tac_toe" / "grpo.yaml"
STEPS = 200
SEED = 1


def gain_noise(p0: float, p1: float, n: int) -> float:
    """Standard error of p1 - p0, each a proportion over n independent games."""
    return math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n)


def test_gain_noise_is_the_binomial_standard_error_of_a_difference() -> None:
    assert gain_noise(0.5, 0.5, 200) == pytest.approx(0.05)
    assert gain_noise(0.0, 1.0, 200) == 0.0


@pytest.mark.timeout(1500)
def test_tic_tac_toe_learns_to_win_through_the_services(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "LUDIC_NUM_STEPS": str(STEPS),
        "LUDIC_SEED": str(SEED),  # the learner's torch seed
        "LUDIC_SEED_BASE": str((SEED + 1) * 1_000_000),  # the feeder's first env seed
    }
    # the held-out sets as shipped but greedy only (the asserted figures; the shipped k: 4
    # sampled games a seed are the README's pass@4 / mean@4), self-play with 16 sampled games
    doc = yaml.safe_load(CONFIG.read_text())
    for eval_set in doc["up"]["eval_sets"]:
        eval_set["k"] = 0 if eval_set["name"] == "vs-heuristic" else 16
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump(doc))
    argv = [
        sys.executable, "-m", "services.cli", "up", "--config", str(config),
        "--runs-dir", str(tmp_path / "runs"), "--init-seed", str(SEED), "--sft-seed", str(SEED),
        "--eval-every-steps", str(10 * STEPS),  # before and after only
        "--timeout-s", "1200", "--no-live",
    ]  # fmt: skip
    log = tmp_path / "up.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )
    try:
        code = proc.wait(1400)
    finally:
        if proc.poll() is None:
            proc.kill()
    wall = time.monotonic() - t0
    assert code == 0, log.read_text(errors="replace")[-4000:]
    summary = json.loads((tmp_path / "runs" / "ttt-grpo" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    vs = summary["eval_sets"]["vs-heuristic"]
    n = int(vs["n"])
    p0, p1 = vs["before"]["pass_rate"], vs["after"]["pass_rate"]
    noise = gain_noise(p0, p1, n)
    print(
        f"tic-tac-toe: win rate {p0:.3f} -> {p1:.3f} (+{100 * (p1 - p0):.1f} points, noise "
        f"{100 * noise:.1f}), illegal {vs['after']['illegal_rate']:.3f}, stale "
        f"{summary['stale_dropped']}, {wall:.0f} s"
    )
    assert p1 - p0 > 2 * noise, (p0, p1, noise)
    assert vs["after"]["illegal_rate"] <= 0.02
    # the self-play set reports both roles
    sp = summary["eval_sets"]["selfplay"]["after"]
    assert {"pass_rate/X", "pass_rate/O", "illegal_rate/X", "illegal_rate/O"} <= set(sp)
    assert summary["stale_dropped"] <= 0.05 * summary["samples_trained"]
