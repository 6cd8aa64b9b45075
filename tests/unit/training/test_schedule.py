"""Learning-rate schedules: the factor at chosen steps (derived in comments), validation,
and the Trainer stepping AdamW at the scheduled rate."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.schedule import lr_factor
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_item


def test_warmup_then_cosine_to_the_floor() -> None:
    # T = 10, warmup 0.2: W = int(0.2 * 10) = 2 steps: s=0 -> 1/2, s=1 -> 2/2
    f = [lr_factor(s, "cosine", 10, 0.2, 0.1) for s in range(12)]
    assert f[0] == 0.5 and f[1] == 1.0
    assert f[2] == 1.0  # progress (2 - 2) / 8 = 0: the top of the cosine
    # s=6: progress 4/8 = 0.5, cos(pi/2) = 0: 0.1 + 0.9 * 0.5 = 0.55
    assert f[6] == pytest.approx(0.55)
    # s=4: progress 0.25: 0.1 + 0.9 * (1 + cos(pi/4)) / 2 = 0.1 + 0.45 * 1.70711 = 0.86820
    assert f[4] == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)  # progress capped at 1
    assert all(a >= b for a, b in zip(f[1:], f[2:], strict=False))  # never rises after warmup


def test_linear_decay_and_constant() -> None:
    # no warmup (int(0.001 * 10) = 0), r = 0: 1 - s / 10
    assert [lr_factor(s, "linear", 10, 0.001, 0.0) for s in (0, 4, 10)] == [1.0, 0.6, 0.0]
    # r = 0.5: 0.5 + 0.5 * (1 - 0.4) = 0.8 at s=4
    assert lr_factor(4, "linear", 10, 0.0, 0.5) == pytest.approx(0.8)
    # constant after a warmup of int(0.3 * 10) = 3 steps: 1/3, 2/3, 1, 1
    assert [lr_factor(s, "constant", 10, 0.3, 0.0) for s in range(4)] == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 1.0]
    )
    assert lr_factor(7, "constant", None, 0.5, 0.0) == 1.0  # no horizon: no warmup


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lr_scheduler_type": "step"}, r"lr_scheduler_type='step'; use one of \['constant'"),
        (
            {"lr_scheduler_type": "cosine"},
            "lr_scheduler_type=.cosine. decays over a horizon: set total_steps",
        ),
        ({"warmup_steps_proportion": 1.0, "total_steps": 5}, r"warmup_steps_proportion=1.0 must"),
        ({"min_lr_ratio": -0.1}, r"min_lr_ratio=-0.1 must be in \[0, 1\]"),
        ({"total_steps": 0}, "total_steps=0 must be >= 1"),
    ],
)
def test_bad_schedule_settings_name_the_field(kw, match) -> None:
    with pytest.raises(ValueError, match="TrainerConfig." + match):
        TrainerConfig(model_device="cpu", **kw)


async def test_the_trainer_steps_at_the_scheduled_rate(tiny_model_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = TrainerConfig(
        model_device="cpu",
        mixed_precision_dtype=None,
        pad_token_id=PAD_ID,
        lr=1e-3,
        lr_scheduler_type="linear",
        warmup_steps_proportion=0.25,
        total_steps=4,
    )
    tr = Trainer(
        model=copy.deepcopy(model),
        algo=make_sft(),
        cfg=cfg,
        batch_source=ListBatchSource([[make_item(4, 3, seed=i)] for i in range(4)]),
    )
    hist = await tr.train(num_steps=4)
    # W = int(0.25 * 4) = 1: s=0 warmup 1/1; then linear over T - W = 3: 1 - (s - 1) / 3
    expected = [1e-3, 1e-3, 1e-3 * 2 / 3, 1e-3 / 3]
    assert [h["lr"] for h in hist] == pytest.approx(expected)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(expected[-1])  # what AdamW used
