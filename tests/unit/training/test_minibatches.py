"""``ppo_n_minibatches``: n optimizer steps per trainer step, with the proximal policy taken
once, before the first of them."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training import loss as L
from libludic.training.algorithm import RLAlgorithm
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import ConstantCredit
from libludic.training.loss import OffPolicyCorrection, ReinforceLoss, TokenClippedSurrogateLoss
from libludic.training.minibatch import combine_minibatch_stats, split_minibatches
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_item

from .test_trainer import SpyLoss, sampled_at


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def cfg(**kw) -> TrainerConfig:
    return TrainerConfig(
        model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, lr=1e-2, **kw
    )


def items6():
    shapes = [(5, 3, 1.0), (9, 6, -0.5), (3, 2, 2.0), (12, 4, 0.3), (4, 7, -1.2), (6, 1, 0.7)]
    return [make_item(s, a, weight=w, seed=i) for i, (s, a, w) in enumerate(shapes)]


def test_split_keeps_order_and_sizes_differ_by_at_most_one() -> None:
    items = [make_item(2, 1, seed=i) for i in range(10)]
    parts = split_minibatches(items, 4)
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [it for p in parts for it in p] == items
    assert split_minibatches(items, 1) == [items]
    with pytest.raises(ValueError, match="cannot split 10 items into 11"):
        split_minibatches(items, 11)
    with pytest.raises(ValueError, match="ppo_n_minibatches=0"):
        cfg(ppo_n_minibatches=0)


async def test_n_minibatches_are_n_steps_on_the_parts(base_model) -> None:
    """One trainer step with ppo_n_minibatches=2 on 6 items = two plain steps, one on each
    half (same constant lr, same AdamW state carried over): the same weights afterwards."""
    algo = RLAlgorithm("t", ConstantCredit(), ReinforceLoss())
    items = items6()
    mini = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        cfg=cfg(ppo_n_minibatches=2),
        batch_source=ListBatchSource([items]),
    )
    plain = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        cfg=cfg(),
        batch_source=ListBatchSource([items[:3], items[3:]]),
    )
    (st,) = await mini.train(num_steps=1)
    h = await plain.train(num_steps=2)
    assert mini.step == 1 and plain.step == 2
    assert st["num_minibatches"] == 2
    assert st["loss"] == pytest.approx((h[0]["loss"] + h[1]["loss"]) / 2, rel=1e-5)
    assert st["grad_norm"] == pytest.approx((h[0]["grad_norm"] + h[1]["grad_norm"]) / 2, rel=1e-5)
    assert st["num_action_tokens"] == h[0]["num_action_tokens"] + h[1]["num_action_tokens"]
    moved = False
    for (n, p), q, b in zip(
        mini.model.named_parameters(),
        plain.model.parameters(),
        base_model.parameters(),
        strict=True,
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
        moved |= not torch.equal(p, b)
    assert moved  # the steps did change the weights: the comparison above is not vacuous


async def test_more_minibatches_than_items_is_one_per_item(base_model) -> None:
    algo = RLAlgorithm("t", ConstantCredit(), ReinforceLoss())
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        cfg=cfg(ppo_n_minibatches=8),
        batch_source=ListBatchSource([items6()[:3]]),
    )
    (st,) = await tr.train(num_steps=1)
    assert st["num_minibatches"] == 3


@pytest.mark.parametrize(
    "correction",
    [
        OffPolicyCorrection(use_decoupled_loss=True),
        # pi_old is the trainer's logprob: without prox the second minibatch's ratio is 1
        OffPolicyCorrection(mismatch_correction="tis"),
        OffPolicyCorrection(mismatch_correction="mis", mismatch_level="sequence"),
    ],
    ids=["decoupled", "tis", "mis-sequence"],
)
def test_the_proximal_policy_is_the_one_the_step_starts_from(base_model, correction) -> None:
    """Two minibatches: the second minibatch's prox logprobs (its pi_old) are the weights
    before the first update, although the first update has changed the weights."""
    items = [
        sampled_at(base_model, make_item(s, a, weight=w, seed=i), 1.0)
        for i, (s, a, w) in enumerate([(5, 3, 1.0), (9, 6, -0.5), (3, 4, 0.5), (6, 2, 1.5)])
    ]
    spy = SpyLoss(TokenClippedSurrogateLoss(off_policy=correction))
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=RLAlgorithm("t", ConstantCredit(), spy),
        batch_source=ListBatchSource([]),
        cfg=cfg(ppo_n_minibatches=2),
    )
    st = tr.stepper.update(items, tr.step)
    assert st["num_minibatches"] == 2 and st["prox_time_s"] > 0
    assert len(spy.batches) == 2  # one micro-batch per minibatch here
    second = spy.batches[1]
    with torch.no_grad():
        before = base_model(input_ids=second["input_ids"], attention_mask=second["attention_mask"])
        after = tr.model(input_ids=second["input_ids"], attention_mask=second["attention_mask"])
    want = L.token_logprobs(L.apply_temperature(before.logits.float(), second), second["input_ids"])
    moved = L.token_logprobs(L.apply_temperature(after.logits.float(), second), second["input_ids"])
    torch.testing.assert_close(second[L.PROX_LOGPROBS_KEY][:, 1:], want)
    assert not torch.allclose(moved, want, atol=1e-4)  # the first update did move the policy
    # the second minibatch trains against the starting policy, whose ratio to the server's
    # (identical) logprobs is 1 at the start of every minibatch: r = pi/pi_prox moved off 1
    assert st["loss/ratio_mean"] != pytest.approx(1.0, abs=1e-6)


async def test_one_minibatch_with_a_mismatch_correction_takes_no_extra_forward(base_model):
    """With one optimizer step per batch, sg(logp) is the policy the step starts from: no
    prox forward for TIS (the decoupled loss always takes one)."""
    algo = RLAlgorithm(
        "t",
        ConstantCredit(),
        TokenClippedSurrogateLoss(off_policy=OffPolicyCorrection(mismatch_correction="tis")),
    )
    assert not algo.prox_logprobs_needed(1) and algo.prox_logprobs_needed(2)
    items = [sampled_at(base_model, it, 1.0) for it in items6()]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        cfg=cfg(),
        batch_source=ListBatchSource([items]),
    )
    (st,) = await tr.train(num_steps=1)
    assert "prox_time_s" not in st and st["num_minibatches"] == 1


def test_stats_of_minibatches_combine_by_their_kind() -> None:
    parts = [
        {
            "loss": 1.0,
            "grad_norm": 2.0,
            "num_action_tokens": 10.0,
            "loss/clip_frac": 0.5,
            "prox_time_s": 0.1,
        },
        {
            "loss": 3.0,
            "grad_norm": 4.0,
            "num_action_tokens": 30.0,
            "loss/clip_frac": 0.1,
            "prox_time_s": 0.2,
        },
    ]
    out = combine_minibatch_stats(parts)
    # means for loss and grad_norm; clip_frac token-weighted (10*0.5 + 30*0.1) / 40 = 0.2; sums
    assert out == pytest.approx(
        {
            "num_minibatches": 2.0,
            "loss": 2.0,
            "grad_norm": 3.0,
            "num_action_tokens": 40.0,
            "loss/clip_frac": 0.2,
            "prox_time_s": 0.3,
        }
    )


def test_max_stats_of_minibatches_combine_with_max() -> None:
    parts = [
        {"num_action_tokens": 10.0, "loss/ratio_max": 1.5, "loss/pg/ratio_max": 1.5},
        {"num_action_tokens": 30.0, "loss/ratio_max": 4.0, "loss/pg/ratio_max": 0.5},
    ]
    out = combine_minibatch_stats(parts)
    # max(1.5, 4.0) = 4 and max(1.5, 0.5) = 1.5, where the token-weighted mean would give
    # (10 * 1.5 + 30 * 4) / 40 = 3.375 and (10 * 1.5 + 30 * 0.5) / 40 = 0.75
    assert out["loss/ratio_max"] == 4.0 and out["loss/pg/ratio_max"] == 1.5


def test_gradient_checkpointing_gives_the_same_gradient(base_model) -> None:
    """Recomputing activations in the backward changes memory, not numbers."""
    algo = RLAlgorithm("t", ConstantCredit(), ReinforceLoss())
    items = items6()
    plain = Trainer(
        model=copy.deepcopy(base_model), algo=algo, cfg=cfg(), batch_source=ListBatchSource([])
    )
    ckpt = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        cfg=cfg(gradient_checkpointing=True),
        batch_source=ListBatchSource([]),
    )
    assert ckpt.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    plain.model.train()
    ckpt.model.train()
    a = plain.accumulate_gradients(items)
    b = ckpt.accumulate_gradients(items)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    for (n, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_gradient_checkpointing_on_a_model_without_it_is_refused() -> None:
    with pytest.raises(
        ValueError, match="gradient_checkpointing=True but Linear does not support it"
    ):
        Trainer(
            model=torch.nn.Linear(2, 2),
            algo=RLAlgorithm("t", ConstantCredit(), ReinforceLoss()),
            cfg=cfg(gradient_checkpointing=True),
            batch_source=ListBatchSource([]),
        )
