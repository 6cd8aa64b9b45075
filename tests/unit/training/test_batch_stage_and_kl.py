"""Batch-level credit (ScaleRL's std over the training batch, not one group) and the KL term
with the Trainer's frozen reference policy, worked by hand."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from libludic.models.tiny import PAD_ID
from libludic.saw import SampleAttachments, SAWItem
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import HybridNormalizedReturn
from libludic.training.loss import LossInputs, loss_inputs
from libludic.training.presets import make_grpo, make_scalerl
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_rollout

# Two groups of 4 with rewards (0,0,0,1) and (0,0,0,5).
#   group means 0.25 and 1.25 -> centred c = (-0.25 x3, 0.75) and (-1.25 x3, 3.75)
#   over the batch of 8: mean(c) = 0, sum c^2 = 3(0.0625) + 0.5625 + 3(1.5625) + 14.0625 = 19.5
#   std_batch = sqrt(19.5 / 8) = sqrt(2.4375) = 1.5612495
#   A = c / std_batch = -0.16013, 0.48038 (group a) and -0.80064, 2.40192 (group b)
STD_BATCH = math.sqrt(19.5 / 8)
WANT_A = [-0.25 / STD_BATCH] * 3 + [0.75 / STD_BATCH]
WANT_B = [-1.25 / STD_BATCH] * 3 + [3.75 / STD_BATCH]
# One group alone (a per-group statistic, what credit alone can compute): group a's std is
# sqrt((3(0.0625) + 0.5625) / 4) = sqrt(0.1875) = 0.4330 -> -0.577, 1.732 (and the same for
# group b, whose c is 5x larger and so is its std): the batch-level statistic is lost.
PER_GROUP = [-0.25 / math.sqrt(0.1875)] * 3 + [0.75 / math.sqrt(0.1875)]


def groups() -> tuple[list[Any], list[Any]]:
    a = [
        make_rollout(f"a{i}", [r], group_id="a", logprobs=[-1.0, -1.0])
        for i, r in enumerate([0, 0, 0, 1])
    ]
    b = [
        make_rollout(f"b{i}", [r], group_id="b", logprobs=[-1.0, -1.0])
        for i, r in enumerate([0, 0, 0, 5])
    ]
    return a, b


def test_numbers_of_the_derivation() -> None:
    assert [round(x, 2) for x in WANT_A[2:]] == [-0.16, 0.48]
    assert [round(x, 2) for x in WANT_B[2:]] == [-0.80, 2.40]
    assert [round(x, 3) for x in PER_GROUP[2:]] == [-0.577, 1.732]


def test_hybrid_over_the_whole_batch_in_one_call() -> None:
    a, b = groups()
    w = HybridNormalizedReturn(group_size=4).compute(a + b)
    assert [w[(r.id, 0)] for r in a] == pytest.approx(WANT_A, rel=1e-6)
    assert [w[(r.id, 0)] for r in b] == pytest.approx(WANT_B, rel=1e-6)


def test_credit_worker_items_one_group_at_a_time_get_the_batch_std_from_apply_batch_stage() -> None:
    algo = make_scalerl(group_size=4, filter_zvp=False)
    a, b = groups()
    # the credit worker's calls: one group each, batch stage deferred
    items = algo.to_saw_items(a, defer_batch_stage=True) + algo.to_saw_items(
        b, defer_batch_stage=True
    )
    assert [it.weight for it in items] == pytest.approx([-0.25] * 3 + [0.75] + [-1.25] * 3 + [3.75])
    assert all(it.pending is not None and it.credited_by == algo.fingerprint for it in items)
    done = algo.apply_batch_stage(items)
    assert [it.weight for it in done] == pytest.approx(WANT_A + WANT_B, rel=1e-6)
    assert all(it.pending is None for it in done)
    assert [it.meta["group_weight"] for it in done] == pytest.approx([it.weight for it in items])
    # positive_only clips after scaling by the std of the *unclipped* c
    # (its group stage is the same, its fingerprint not: the items are restamped)
    pos = make_scalerl(group_size=4, filter_zvp=False, positive_only=True)
    got = pos.apply_batch_stage(
        [dataclasses.replace(it, credited_by=pos.fingerprint) for it in items]
    )
    assert [it.weight for it in got] == pytest.approx(
        [max(x, 0.0) for x in WANT_A + WANT_B], rel=1e-6
    )


def test_batch_stage_errors_name_the_fix() -> None:
    algo = make_scalerl(group_size=4, filter_zvp=False)
    a, b = groups()
    pending = algo.to_saw_items(a, defer_batch_stage=True)
    finished = algo.to_saw_items(b)
    with pytest.raises(ValueError, match="either the credit worker's items or fully credited"):
        algo.apply_batch_stage(pending + finished)
    with pytest.raises(ValueError, match="top-level algorithm: section"):
        make_grpo(group_size=4).apply_batch_stage(pending)
    # algorithms without a batch stage are unaffected by defer_batch_stage
    g = make_grpo(group_size=4).to_saw_items(a, defer_batch_stage=True)
    assert all(it.pending is None for it in g)


def cpu_cfg(**kw: Any) -> TrainerConfig:
    return TrainerConfig(model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, **kw)


@dataclass
class Recording:
    """Wraps a loss; records the weights of every micro-batch it sees."""

    inner: Any
    seen: list[float]

    @property
    def requires(self) -> LossInputs:
        return loss_inputs(self.inner)

    def compute(
        self, logits: torch.Tensor, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        self.seen.extend(float(x) for x in batch["weight"])
        return self.inner.compute(logits, batch)


async def test_trainer_applies_the_batch_stage_to_exactly_its_batch(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    algo = make_scalerl(group_size=4, filter_zvp=False)
    a, b = groups()
    items = algo.to_saw_items(a, defer_batch_stage=True) + algo.to_saw_items(
        b, defer_batch_stage=True
    )
    seen: list[float] = []
    algo.loss = Recording(algo.loss, seen)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tr = Trainer(model=model, algo=algo, batch_source=ListBatchSource([items]), cfg=cpu_cfg())
    await tr.train_step()
    assert sorted(seen) == pytest.approx(sorted(WANT_A + WANT_B), rel=1e-5)


# ---------------------------------------------------------------------------------- KL


class ConstLogits(nn.Module):
    """logits[b, t] = bias for every position (vocab 2); the bias is the only parameter."""

    def __init__(self, bias: list[float], trainable: bool = True) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.tensor(bias), requires_grad=trainable)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(input_ids.shape[0], input_ids.shape[1], 2)


def kl_item() -> SAWItem:
    # input_ids (0, 1, 0); the last two tokens are actions (predicted from positions 0 and 1)
    return SAWItem(
        input_ids=[0, 1, 0],
        attention_mask=[1, 1, 1],
        action_mask=[0, 1, 1],
        weight=0.0,  # advantage 0: the clipped-surrogate term is exactly 0, only KL is left
        meta={"item_id": "kl0"},
        attachments=SampleAttachments(actor_logprobs=[0.0, math.log(0.5), math.log(0.5)]),
    )


async def test_kl_term_with_the_trainers_reference_policy_by_hand() -> None:
    # policy: logits (0, 0) -> p = (1/2, 1/2), logp = log 1/2 for both action tokens
    # reference: logits (0, log 3) -> p = (1/4, 3/4)
    #   token 1 (id 1): lr = log 3/4 - log 1/2 = log 1.5 -> k3 = e^lr - 1 - lr = 0.5 - log 1.5
    #   token 2 (id 0): lr = log 1/4 - log 1/2 = log 0.5 -> k3 = 0.5 - 1 + log 2 = log 2 - 0.5
    #   kl (token mean) = (0.0945349 + 0.1931472) / 2 = 0.1438410; loss = kl_coeff * kl
    want_kl = ((0.5 - math.log(1.5)) + (math.log(2.0) - 0.5)) / 2
    algo = make_grpo(group_size=1, kl_coeff=0.5)
    assert algo.needs_ref_logprobs
    policy = ConstLogits([0.0, 0.0])
    ref = ConstLogits([0.0, math.log(3.0)], trainable=False)
    tr = Trainer(
        model=policy,
        algo=algo,
        batch_source=ListBatchSource([[kl_item()]]),
        cfg=cpu_cfg(max_grad_norm=None),
        reference_model=ref,
    )
    stats = await tr.train_step()
    assert stats["loss/kl/kl"] == pytest.approx(want_kl, rel=1e-5)
    assert stats["loss"] == pytest.approx(0.5 * want_kl, rel=1e-5)
    assert stats["ref_time_s"] >= 0.0
    # d loss / d bias: per token, d k3 / d logp = 1 - e^lr, and d logp(y) / d bias = onehot(y) - p
    #   token 1 (y=1, e^lr = 1.5): (1 - 1.5) * (-1/2, 1/2) = (0.25, -0.25)
    #   token 2 (y=0, e^lr = 0.5): (1 - 0.5) * (1/2, -1/2) = (0.25, -0.25)
    #   mean over 2 tokens x kl_coeff 0.5 -> (0.125, -0.125): the step moves the policy
    #   toward the reference (bias[1] up, bias[0] down)
    assert float(policy.bias[1].detach()) > 0.0 > float(policy.bias[0].detach())
    assert ref.bias.tolist() == pytest.approx([0.0, math.log(3.0)])  # frozen


@pytest.mark.parametrize(
    "estimator, want, moves",
    [
        # same policy/reference as above: lr = log 1.5 (token 1) and log 0.5 (token 2)
        # k1 = -lr: (-log 1.5 - log 0.5) / 2 = log(4/3) / 2 = 0.1438410 (k3's value here too,
        #   since e^lr - 1 sums to 0 over the two tokens); but d k1 / d logp = -1 per token and
        #   d logp(y) / d bias = onehot(y) - p: (-1/2, 1/2) + (1/2, -1/2) = 0: the policy stays
        ("k1", math.log(4.0 / 3.0) / 2, False),
        # k2 = lr^2 / 2: (log(1.5)^2 + log(0.5)^2) / 4 = (0.1644 + 0.4805) / 4 = 0.1612219;
        #   d k2 / d logp = -lr: token 1 -log 1.5 x (-1/2, 1/2), token 2 -log 0.5 x (1/2, -1/2)
        #   = (0.2027 + 0.3466, ...) != 0: it moves toward the reference as k3 does
        ("k2", (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 4, True),
    ],
)
async def test_kl_estimator_is_a_preset_kwarg(estimator, want, moves) -> None:
    algo = make_grpo(group_size=1, kl_coeff=0.5, kl_estimator=estimator)
    policy = ConstLogits([0.0, 0.0])
    tr = Trainer(
        model=policy,
        algo=algo,
        batch_source=ListBatchSource([[kl_item()]]),
        cfg=cpu_cfg(max_grad_norm=None),
        reference_model=ConstLogits([0.0, math.log(3.0)], trainable=False),
    )
    stats = await tr.train_step()
    assert stats["loss/kl/kl"] == pytest.approx(want, rel=1e-5)
    assert stats["loss"] == pytest.approx(0.5 * want, rel=1e-5)
    bias = policy.bias.detach().tolist()
    if moves:
        assert bias[1] > 0.0 > bias[0]
    else:
        assert bias == pytest.approx([0.0, 0.0], abs=1e-7)


def test_a_bad_kl_estimator_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kl_estimator='k4'; use one of \['k1', 'k2', 'k3'\]"):
        make_grpo(kl_coeff=0.1, kl_estimator="k4")


def test_kl_gradient_by_hand() -> None:
    algo = make_grpo(group_size=1, kl_coeff=0.5)
    policy = ConstLogits([0.0, 0.0])
    tr = Trainer(
        model=policy,
        algo=algo,
        batch_source=ListBatchSource([[kl_item()]]),
        cfg=cpu_cfg(max_grad_norm=None),
        reference_model=ConstLogits([0.0, math.log(3.0)], False),
    )
    tr.accumulate_gradients([kl_item()])
    assert policy.bias.grad.tolist() == pytest.approx([0.125, -0.125], rel=1e-5)


async def test_default_reference_is_a_frozen_copy_of_the_initial_policy(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from tests.fakes import make_item

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    items = [make_item(5, 3, weight=w, seed=i) for i, w in enumerate([1.0, -1.0, 0.5, -0.5])]
    tr = Trainer(
        model=model,
        algo=make_grpo(group_size=4, kl_coeff=0.1),
        batch_source=ListBatchSource([items]),
        cfg=cpu_cfg(lr=1e-2),
    )
    assert tr.ref_model is not None and tr.ref_model is not tr.model
    before = {k: v.clone() for k, v in tr.ref_model.state_dict().items()}
    s1 = await tr.train_step()
    assert s1["loss/kl/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    s2 = await tr.train_step()
    assert s2["loss/kl/kl"] > 1e-6  # the policy moved, the reference did not
    after = tr.ref_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(p.requires_grad for p in tr.ref_model.parameters())


async def test_with_lora_the_reference_is_the_base_with_adapters_off_not_a_copy(
    tiny_model_dir,
) -> None:
    """peft starts every adapter at B = 0, so at step 1 the policy is the base (KL 0); after
    an update the adapters moved and the reference (adapters off) did not: the KL is then
    that of a Trainer holding a frozen copy of the base."""
    from transformers import AutoModelForCausalLM

    from tests.fakes import make_item

    items = [make_item(5, 3, weight=w, seed=i) for i, w in enumerate([1.0, -1.0, 0.5, -0.5])]

    def trainer(copy_reference: bool) -> Trainer:
        torch.manual_seed(0)  # the same adapter initialisation in both
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        ref = None
        if copy_reference:
            ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        return Trainer(
            model=model,
            algo=make_grpo(group_size=4, kl_coeff=0.1),
            batch_source=ListBatchSource([items, items]),
            cfg=cpu_cfg(lr=1e-2, lora_rank=4),
            reference_model=ref,
        )

    tr, copied = trainer(False), trainer(True)
    assert tr.ref_is_base and tr.ref_model is None  # no second model in memory
    assert not copied.ref_is_base and copied.ref_model is not None
    s1, c1 = await tr.train_step(), await copied.train_step()
    assert s1["loss/kl/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == base at step 1
    assert s1["loss"] == pytest.approx(c1["loss"], rel=1e-6)  # the same policy in both
    s2, c2 = await tr.train_step(), await copied.train_step()
    assert s2["loss/kl/kl"] > 1e-6  # the adapters moved, the base did not
    assert s2["loss/kl/kl"] == pytest.approx(c2["loss/kl/kl"], rel=1e-5)
    assert "ref_time_s" in s2
