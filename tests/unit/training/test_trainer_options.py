"""TrainerConfig options under AReaL's names: ``optimizer_type`` (``optimizer.type``; AdamW by
default, plain SGD when asked: one step moves each weight by -lr x its gradient) and
``min_micro_batches`` (``mb_spec.n_mbs``)."""

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


def test_min_micro_batches_splits_a_step_and_keeps_its_gradient(base_model) -> None:
    """AReaL's mb_spec.n_mbs: at least this many micro-batches, the same summed gradient."""
    items = [make_item(5 + i, 3, seed=i) for i in range(6)]
    one, four = (
        trainer(copy.deepcopy(base_model)),
        trainer(copy.deepcopy(base_model), min_micro_batches=4),
    )
    s1, s4 = one.accumulate_gradients(items), four.accumulate_gradients(items)
    assert (s1["num_micro_batches"], s4["num_micro_batches"]) == (1, 4)
    for p, q in zip(one.model.parameters(), four.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="min_micro_batches"):
        TrainerConfig(min_micro_batches=0)
