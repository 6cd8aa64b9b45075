"""PPO's clipped value loss and the ratio losses' per-token advantages, on hand numbers."""

from __future__ import annotations

import pytest
import torch

from libludic.training import loss as L
from libludic.training.value_loss import (
    OLD_VALUES_KEY,
    RETURNS_KEY,
    VALUES_KEY,
    ClippedValueLoss,
)

# One sequence of 5 tokens, the last 3 actions: on the shifted grid [1, 4] the action
# positions are 1, 2, 3 (position 0 is state, its numbers must not count).
V = [9.0, 1.0, 0.2, -0.6]
V_OLD = [7.0, 0.5, 0.5, 0.0]
RET = [5.0, 2.0, 0.0, -0.1]


def batch(values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5]]),
        "attention_mask": torch.ones(1, 5, dtype=torch.int64),
        "action_mask": torch.tensor([[0, 0, 1, 1, 1]]),
        "weight": torch.tensor([100.0]),  # a reward here: the value loss never reads it
        "actor_logprobs": torch.zeros(1, 5),
        VALUES_KEY: values,
        OLD_VALUES_KEY: torch.tensor([V_OLD]),
        RETURNS_KEY: torch.tensor([RET]),
    }


def test_clipped_value_loss_against_hand_numbers() -> None:
    # value_eps_clip 0.2, per action token (V_clip = V_old + clip(V - V_old, -0.2, 0.2)):
    #   t1: V 1.0,  V_old 0.5, R 2.0:  V_clip 0.7;  (V-R)^2 = 1.0,  (V_clip-R)^2 = 1.69 -> 1.69 (clipped)
    #   t2: V 0.2,  V_old 0.5, R 0.0:  V_clip 0.3;  0.04, 0.09 -> 0.09 (clipped)
    #   t3: V -0.6, V_old 0.0, R -0.1: V_clip -0.2; 0.25, 0.01 -> 0.25
    #   L = 1/2 (1.69 + 0.09 + 0.25) / 3 = 0.3383333 (token mean)
    #   clip_frac = 2/3, value_mean = (1.0 + 0.2 - 0.6) / 3 = 0.2, return_mean = 1.9 / 3
    # dL/dV: a clipped token's V_clip is at the clip's edge, so it passes no gradient;
    #   t3: (V - R) / 3 = -0.5 / 3
    v = torch.tensor([V], requires_grad=True)
    loss, stats = ClippedValueLoss(value_eps_clip=0.2).compute(torch.zeros(1, 5, 3), batch(v))
    assert float(loss.detach()) == pytest.approx(0.5 * 2.03 / 3, rel=1e-6)
    assert float(stats["clip_frac"]) == pytest.approx(2 / 3)
    assert float(stats["value_mean"]) == pytest.approx(0.2, rel=1e-6)
    assert float(stats["return_mean"]) == pytest.approx(1.9 / 3, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.0, 0.0, -0.5 / 3]]))


def test_unclipped_value_loss_is_half_the_squared_error() -> None:
    # value_eps_clip None: L = 1/2 ((1 - 2)^2 + 0.2^2 + (-0.5)^2) / 3 = 1/2 * 1.29 / 3 = 0.215
    # dL/dV = (V - R) / 3 = [-1/3, 0.2/3, -0.5/3] on the action positions
    v = torch.tensor([V], requires_grad=True)
    loss, stats = ClippedValueLoss(value_eps_clip=None).compute(torch.zeros(1, 5, 3), batch(v))
    assert float(loss.detach()) == pytest.approx(0.215, rel=1e-6)
    assert float(stats["clip_frac"]) == 0.0
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -1 / 3, 0.2 / 3, -0.5 / 3]]))


def test_value_loss_uses_the_step_token_count() -> None:
    # the Trainer's macro-batch count: 6 action tokens in the step -> the sum / 6
    v = torch.tensor([V])
    b = {**batch(v), L.NUM_ACTION_TOKENS_KEY: 6.0}
    loss, _ = ClippedValueLoss(value_eps_clip=0.2).compute(torch.zeros(1, 5, 3), b)
    assert float(loss) == pytest.approx(0.5 * 2.03 / 6, rel=1e-6)


def test_the_surrogate_reads_per_token_advantages_when_the_batch_has_them() -> None:
    # ratio 1 (actor_logprobs = the model's), A per token [., 1.0, -2.0, 0.5] on the action
    # positions, the weight 100 ignored: L = -(1.0 - 2.0 + 0.5) / 3 = 1/6
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 7)
    b = batch(torch.zeros(1, 4))
    b["input_ids"] = torch.tensor([[1, 2, 3, 4, 5]])
    lp = torch.zeros(1, 5)
    lp[:, 1:] = L.token_logprobs(logits, b["input_ids"])
    b["actor_logprobs"] = lp
    b[L.ADVANTAGES_KEY] = torch.tensor([[50.0, 1.0, -2.0, 0.5]])
    loss, stats = L.TokenClippedSurrogateLoss().compute(logits, b)
    assert float(loss) == pytest.approx(1 / 6, rel=1e-5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.0)
    # without them, the weight is every token's advantage, as before: L = -100
    del b[L.ADVANTAGES_KEY]
    loss, _ = L.TokenClippedSurrogateLoss().compute(logits, b)
    assert float(loss) == pytest.approx(-100.0, rel=1e-5)


def test_the_value_loss_declares_what_it_reads() -> None:
    assert L.loss_inputs(ClippedValueLoss()) == L.LossInputs(values=True)
    composite = L.CompositeLoss(
        [L.LossTerm("pg", L.TokenClippedSurrogateLoss()), L.LossTerm("value", ClippedValueLoss())]
    )
    assert L.loss_inputs(composite) == L.LossInputs(actor_logprobs=True, values=True)


@pytest.mark.parametrize("eps", [0.0, -0.5, True, "0.2"])
def test_value_eps_clip_must_be_positive_or_none(eps) -> None:
    with pytest.raises(ValueError, match=r"value_eps_clip=.* must be a number > 0 .*or None"):
        ClippedValueLoss(value_eps_clip=eps)


def test_a_batch_without_the_critics_values_is_refused_with_the_fix() -> None:
    b = batch(torch.zeros(1, 4))
    del b[VALUES_KEY], b[RETURNS_KEY]
    with pytest.raises(KeyError, match=r"needs batch \['values', 'returns'\].*make_ppo"):
        ClippedValueLoss().compute(torch.zeros(1, 5, 3), b)
