"""``TrainerConfig.optimizer_type`` (AReaL's ``optimizer.type``): AdamW by default, plain SGD
when asked: one step moves each weight by -lr x its gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training.config import TrainerConfig
from libludic.training.presets import make_sft
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_item


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def trainer(model, **kw) -> Trainer:
    cfg = TrainerConfig(model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, **kw)
    return Trainer(model=model, algo=make_sft(), batch_source=ListBatchSource([]), cfg=cfg)


def test_sgd_steps_by_minus_lr_times_the_gradient(base_model) -> None:
    tr = trainer(
        copy.deepcopy(base_model),
        optimizer_type="sgd",
        lr=0.5,
        weight_decay=0.0,
        max_grad_norm=None,
    )
    assert type(tr.stepper.optimizer) is torch.optim.SGD
    tr.accumulate_gradients([make_item(6, 4, seed=i) for i in range(3)])
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    tr.stepper.optimizer_step(0)
    assert grads
    for n, p in tr.model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n])


def test_adam_is_the_default_and_unknown_types_are_refused(base_model) -> None:
    assert type(trainer(copy.deepcopy(base_model)).stepper.optimizer) is torch.optim.AdamW
    with pytest.raises(ValueError, match="optimizer_type"):
        TrainerConfig(optimizer_type="lion")
