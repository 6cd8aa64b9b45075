"""`ludic up` with the algorithm options switched on together, tiny model, a few steps.

Run 1, grpo: AReaL's decoupled PPO (``use_decoupled_loss``, ``recompute_logprob``,
``behav_imp_weight_cap``), dynamic sampling, DAPO's overlong penalty, leave-one-out reward
normalisation and batch advantage normalisation, a k2 KL term, two PPO minibatches, a cosine
learning-rate schedule with warmup, gradient checkpointing, and top_k / stop_token_ids in
generation. Run 2, dr_grpo: TIS (which refuses to combine with the decoupled loss) with two
minibatches, whose pi_old is then the proximal policy the Trainer recomputes.

The outcomes are read from what the learner writes: TensorBoard's event files (every step's
stats, read back with TensorBoard's reader), ``learner_final.json`` and ``summary.json``.

Why the runs can train at all: a random tiny model scores 0 on arithmetic, so every group
would have zero reward variance and dynamic sampling would drop all of them. Generation is
2 tokens among the top 20 (``top_k``), and a seventh of the vocabulary ends it
(``stop_token_ids``): a completion stopped after its first token has length 1, else 2, and
the overlong penalty (``max_new_tokens`` 2, ``overlong_tokens`` 1, factor 1) gives it
reward 0, else -1. Over 40 train prompts of this model the first token stops with
probability 0.10 on average, so a group of 4 has zero variance with probability about
0.66 (``(1-q)^4 + q^4``): groups are dropped and others kept, on every run. Without the stop
ids reaching vLLM every completion has length 2 (EOS aside), no group would be kept and the
run would time out.

Starts vLLM: run under ``flock /tmp/ludic-heavy.lock``, one test at a time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_up import config, finished, ludic_up, procs_of_run  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.up]

STEPS = 4
LR = 1e-3
SAMPLING = {
    "temperature": 1.0,
    "max_tokens": 2,
    "top_k": 20,
    "stop_token_ids": list(range(0, 259, 7)),
}
OVERLONG = {
    "max_new_tokens": 2,
    "overlong_reward_penalty": True,
    "overlong_tokens": 1,
    "overlong_penalty_factor": 1.0,
}


def run(tmp_path: Path, model: Path, run_id: str, algorithm: dict) -> tuple[Path, dict]:
    """``ludic up`` of ``algorithm`` for STEPS steps; (its run dir, its step stats by tag)."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (the dev extras)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(tmp_path, model, run_id, num_steps=STEPS, eval_n=0)
    data = yaml.safe_load(cfg.read_text())
    data["algorithm"] = algorithm
    data["feeder"]["tasks"][0]["inference"]["sampling"] = SAMPLING
    tb = tmp_path / "tb"
    data["learner"].update(lr=LR, tensorboard_dir=str(tb))
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "runs" / run_id
    finished(
        ludic_up(cfg, tmp_path / "up.log"), tmp_path / "up.log", also=run_dir / "logs/learner.log"
    )
    time.sleep(1)
    assert procs_of_run(run_id) == [], "services left running after ludic up exited"
    ev = EventAccumulator(str(tb))
    ev.Reload()
    stats = {
        tag: [e.value for e in sorted(ev.Scalars(tag), key=lambda e: e.step)]
        for tag in ev.Tags()["scalars"]
    }
    assert stats["step"] == list(range(1, STEPS + 1)), stats["step"]
    return run_dir, stats


def test_up_trains_with_the_algorithm_options_switched_on_together(tmp_path, tiny_model_dir):
    algorithm = {
        "name": "grpo",
        "group_size": 4,
        "lr_scheduler_type": "cosine",
        "warmup_steps_proportion": 0.5,
        "min_lr_ratio": 0.1,
        "ppo_n_minibatches": 2,
        "gradient_checkpointing": True,
        "kwargs": {
            "use_decoupled_loss": True,
            "recompute_logprob": True,
            "behav_imp_weight_cap": 5.0,
            "dynamic_sampling": True,
            **OVERLONG,
            "reward_norm": {"mean_level": "group", "mean_leave1out": True, "std_level": None},
            "adv_norm": {"mean_level": "batch", "std_level": "batch"},
            "kl_coeff": 0.05,
            "kl_estimator": "k2",
        },
    }
    run_dir, st = run(tmp_path, tiny_model_dir, f"upopt-{os.getpid()}", algorithm)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] >= STEPS and s["samples_trained"] >= STEPS * 8
    # the schedule over num_steps T = 4 with W = int(0.5 * 4) = 2 warmup steps: factors
    # (0+1)/2 = 0.5, 2/2 = 1, then the cosine at progress (s - 2) / (4 - 2) = 0 and 0.5:
    # 0.1 + 0.9 * (1 + cos 0) / 2 = 1 and 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55
    assert st["lr"] == pytest.approx([0.5 * LR, LR, LR, 0.55 * LR])
    assert st["num_minibatches"] == [2.0] * STEPS
    # the decoupled loss's proximal forward and the KL term's reference forward ran
    assert all(t > 0 for t in st["prox_time_s"]) and all(t > 0 for t in st["ref_time_s"])
    assert len(st["loss/kl/kl"]) == STEPS and len(st["loss/pg/mismatch_capped_frac"]) == STEPS
    # top_k reached vLLM: its logprobs are those of the top 20 renormalised, about 2 nats
    # above the trainer's over the whole vocabulary (1e-6 apart without top_k, fp32 serving)
    assert all(g > 0.5 for g in st["loss/pg/mismatch_logprob_gap"]), st
    # kept groups have shaped rewards that differ (the stop ids and the overlong penalty at
    # work): every batch has advantages of both signs, after the batch normalisation
    assert all(a > 0 for a in st["adv_std"]), st["adv_std"]
    final = json.loads((run_dir / "learner" / "learner_final.json").read_text())
    assert final["gradient_checkpointing"] is True
    acct = final["accounting"]
    assert acct["consistent"], acct
    # dynamic sampling dropped groups, counted by credit in the run accounting and logged by
    # the learner at every step as a running total
    assert acct["groups_zero_variance"] >= 1, acct
    assert st["run/dynamic_sampling_dropped_total"][-1] >= 1
    assert st["run/dynamic_sampling_dropped_total"] == sorted(
        st["run/dynamic_sampling_dropped_total"]
    )


def test_up_trains_dr_grpo_with_tis_and_minibatches(tmp_path, tiny_model_dir):
    algorithm = {
        "name": "dr_grpo",
        "group_size": 4,
        "ppo_n_minibatches": 2,
        "kwargs": {"mismatch_correction": "tis", "mismatch_cap": 2.0, **OVERLONG},
    }
    run_dir, st = run(tmp_path, tiny_model_dir, f"updrgrpo-{os.getpid()}", algorithm)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] >= STEPS and s["samples_trained"] >= STEPS * 8
    assert st["lr"] == pytest.approx([LR] * STEPS)  # constant: the default schedule
    assert st["num_minibatches"] == [2.0] * STEPS
    # TIS with two minibatches: pi_old is the policy the step starts from, recomputed
    assert all(t > 0 for t in st["prox_time_s"])
    # rho = pi_trainer / pi_served < 1 under top_k (served: renormalised over the top 20),
    # so the TIS weight min(rho, 2) = rho, about exp(-2) on average
    assert all(0 < w < 0.9 for w in st["loss/mismatch_weight_mean"]), st
    final = json.loads((run_dir / "learner" / "learner_final.json").read_text())
    assert final["gradient_checkpointing"] is False and final["accounting"]["consistent"]
