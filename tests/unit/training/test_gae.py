"""GAE (libludic/training/gae.py) against hand-derived numbers on fixed trajectories."""

from __future__ import annotations

import pytest
import torch

from libludic.saw import SAWItem
from libludic.training.gae import GAE, gae

# One episode of four action tokens, the reward 1.0 at the last one, the critic's values
# V = [0.5, 0.25, -0.5, 1.0] (V_4 = 0: the episode ends).
R4 = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
V4 = torch.tensor([[0.5, 0.25, -0.5, 1.0]])


def test_gamma_1_lambda_1_is_the_return_minus_the_value() -> None:
    # gamma = lambda = 1: A_t = sum_{s >= t} r_s - V_t = 1 - V_t
    #   A = [1 - 0.5, 1 - 0.25, 1 + 0.5, 1 - 1.0] = [0.5, 0.75, 1.5, 0.0]
    #   R = A + V = [1, 1, 1, 1], the return of every token
    adv, ret = gae(R4, V4, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75, 1.5, 0.0]]))
    torch.testing.assert_close(ret, torch.ones(1, 4))


def test_lambda_0_is_the_one_step_td_error() -> None:
    # lambda = 0, gamma = 1: A_t = delta_t = r_t + V_{t+1} - V_t
    #   t0: 0 + 0.25 - 0.5  = -0.25
    #   t1: 0 - 0.5  - 0.25 = -0.75
    #   t2: 0 + 1.0  + 0.5  =  1.5
    #   t3: 1 + 0    - 1.0  =  0.0
    #   R = A + V = r_t + V_{t+1} = [0.25, -0.5, 1.0, 1.0]
    adv, ret = gae(R4, V4, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-0.25, -0.75, 1.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.25, -0.5, 1.0, 1.0]]))


def test_discounted_gae_and_zero_padding_end_the_episode() -> None:
    # gamma = 0.9, lambda = 0.5 (gamma lambda = 0.45), r = [0, 0.5, 0, 1],
    # V = [0.2, 0.4, 0.6, 0.8]; row 2 is a one-token episode (r 2.0, V 0.5) padded with zeros.
    #   delta_3 = 1   + 0.9 * 0   - 0.8 = 0.2
    #   delta_2 = 0   + 0.9 * 0.8 - 0.6 = 0.12
    #   delta_1 = 0.5 + 0.9 * 0.6 - 0.4 = 0.64
    #   delta_0 = 0   + 0.9 * 0.4 - 0.2 = 0.16
    #   A_3 = 0.2
    #   A_2 = 0.12 + 0.45 * 0.2    = 0.21
    #   A_1 = 0.64 + 0.45 * 0.21   = 0.7345
    #   A_0 = 0.16 + 0.45 * 0.7345 = 0.490525
    #   R   = A + V = [0.690525, 1.1345, 0.81, 1.0]
    # row 2: A_0 = 2.0 + 0.9 * 0 - 0.5 = 1.5 (the padding's V = 0 ends it), R_0 = 2.0
    rewards = torch.tensor([[0.0, 0.5, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 0.8], [0.5, 0.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, gamma=0.9, lam=0.5)
    torch.testing.assert_close(
        adv, torch.tensor([[0.490525, 0.7345, 0.21, 0.2], [1.5, 0.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(
        ret, torch.tensor([[0.690525, 1.1345, 0.81, 1.0], [2.0, 0.0, 0.0, 0.0]])
    )


def step_item(rollout: str | None, step: int, n_action: int, reward: float) -> SAWItem:
    meta = {"item_id": f"{rollout}:{step}", "step_index": step}
    if rollout is not None:
        meta["rollout_id"] = rollout
    return SAWItem(
        input_ids=list(range(3 + n_action)),
        attention_mask=[1] * (3 + n_action),
        action_mask=[0] * 3 + [1] * n_action,
        weight=reward,
        meta=meta,
    )


def test_per_item_joins_a_rollouts_steps_in_step_order() -> None:
    # The trajectory of test_discounted_gae...: rollout "a" has two steps of two action
    # tokens, step 0 rewarded 0.5, step 1 rewarded 1.0 (each item's weight, at its last action
    # token), V = [0.2, 0.4] and [0.6, 0.8]. The items come step 1 first, with a one-step
    # rollout "b" and an item without a rollout id (its own episode) among them:
    #   a:1 -> A = [0.21, 0.2],         R = [0.81, 1.0]
    #   a:0 -> A = [0.490525, 0.7345],  R = [0.690525, 1.1345]   (as derived above)
    #   b:0 -> r = [0, 0, 3], V = [1, 1, 1]: delta = [0.9 - 1, 0.9 - 1, 3 - 1] = [-0.1, -0.1, 2]
    #          A_2 = 2, A_1 = -0.1 + 0.45 * 2 = 0.8, A_0 = -0.1 + 0.45 * 0.8 = 0.26
    #   None -> r = [-1], V = [0]: A = R = [-1]
    items = [
        step_item("a", 1, 2, 1.0),
        step_item("b", 0, 3, 3.0),
        step_item(None, 0, 1, -1.0),
        step_item("a", 0, 2, 0.5),
    ]
    values = [
        torch.tensor([0.6, 0.8]),
        torch.ones(3),
        torch.zeros(1),
        torch.tensor([0.2, 0.4]),
    ]
    out = GAE(gamma=0.9, gae_lambda=0.5).per_item(items, values)
    want = [
        ([0.21, 0.2], [0.81, 1.0]),
        ([0.26, 0.8, 2.0], [1.26, 1.8, 3.0]),
        ([-1.0], [-1.0]),
        ([0.490525, 0.7345], [0.690525, 1.1345]),
    ]
    for (adv, ret), (wa, wr) in zip(out, want, strict=True):
        torch.testing.assert_close(adv, torch.tensor(wa))
        torch.testing.assert_close(ret, torch.tensor(wr))


def test_an_item_without_action_tokens_adds_nothing() -> None:
    # an inert item (as a rank with too few items adds under FSDP2): no token, no reward
    items = [step_item("a", 0, 2, 1.0), step_item("a", 1, 0, 5.0)]
    out = GAE().per_item(items, [torch.zeros(2), torch.zeros(0)])
    torch.testing.assert_close(out[0][0], torch.tensor([1.0, 1.0]))
    assert out[1][0].numel() == 0 and out[1][1].numel() == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"gamma": 1.5}, r"GAE gamma=1.5 must be a number in \[0, 1\] \(the per-token discount"),
        ({"gae_lambda": -0.1}, r"GAE gae_lambda=-0.1 must be a number in \[0, 1\]"),
        ({"gamma": True}, r"GAE gamma=True must be a number"),
    ],
)
def test_constants_outside_0_1_are_refused(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        GAE(**kw)
