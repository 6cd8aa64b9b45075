"""scripts/soak.py's verdict on a stream: a queue held by backpressure may reach its ceiling
(high-water mark plus what its producers had started) in any third of the soak; a stream
that climbs past it is growing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "scripts" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak_under_test", SOAK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def samples(values: list[int]) -> list[dict]:
    """One sample per 4 s of a 2-minute soak (30 samples), the rollouts stream at ``values``."""
    return [{"t": 4.0 * i, "stream/rollouts": v} for i, v in enumerate(values)]


def test_ceilings_add_what_producers_start_before_the_backlog_is_full(tmp_path):
    soak = load_soak()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "algorithm": {"name": "grpo", "group_size": 8},
                "feeder": {"high_water": 16},
                "actor": {"concurrency": 8, "max_steps": 1, "rollouts_high_water": 64},
                "credit": {"saw_high_water": 128},
            }
        )
    )
    got = soak.stream_ceilings(cfg, actors=4)
    # requests: topped up to 16; rollouts: 64 + 4 actors x 8 requests x 8 rollouts = 320;
    # saw: 128 + one group of 8 one-step rollouts = 136
    assert got == {"stream/requests": 16, "stream/rollouts": 320, "stream/saw": 136}


def test_a_queue_that_fills_late_is_bounded_and_one_that_climbs_past_its_ceiling_is_not():
    soak = load_soak()
    ceilings = {"stream/rollouts": 320}
    # middle third at most 24, last third up to 128 (the consumer became the slower side):
    # bound = 24 x 1.10 + 320 = 346.4
    filled_late = [10] * 10 + [24] * 10 + [128] * 10
    (row,) = soak.judge(samples(filled_late), 2.0, ceilings)
    assert row["bounded"] is True
    # never deleted: +40 per sample, middle max 760, last max 1160 > 760 x 1.10 + 320 = 1156
    leaking = [40 * i for i in range(30)]
    (row,) = soak.judge(samples(leaking), 2.0, ceilings)
    assert row["bounded"] is False
