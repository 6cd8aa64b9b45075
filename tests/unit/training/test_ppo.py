"""The ``ppo`` preset: its composition, its options refused with the fix, its items (step
rewards), and PPO trained in one process on the tiny model (RolloutBatchSource)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.requests import EnvSpec, RolloutRequest
from libludic.training import loss as L
from libludic.training.algorithm import RLAlgorithm
from libludic.training.algorithm_spec import AlgorithmSpec
from libludic.training.batching.rollout_batch_source import RolloutBatchSource
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import HybridNormalizedReturn, StepReward
from libludic.training.gae import GAE
from libludic.training.presets import make_ppo
from libludic.training.trainer import Trainer
from libludic.training.value_loss import ClippedValueLoss
from tests.fakes import make_rollout


def test_ppo_is_step_rewards_gae_and_the_clipped_surrogate_plus_the_value_loss() -> None:
    a = make_ppo(gamma=0.99, gae_lambda=0.95, eps_clip=0.1, value_eps_clip=0.3)
    assert a.name == "ppo" and isinstance(a.credit_assigner, StepReward)
    assert a.gae == GAE(gamma=0.99, gae_lambda=0.95) and a.needs_critic
    assert isinstance(a.loss, L.CompositeLoss)
    pg, value = a.loss.terms
    assert (pg.name, pg.coeff, value.name, value.coeff) == ("pg", 1.0, "value", 1.0)
    assert isinstance(pg.loss, L.TokenClippedSurrogateLoss) and pg.loss.eps_clip == 0.1
    assert isinstance(value.loss, ClippedValueLoss) and value.loss.value_eps_clip == 0.3
    assert a.inputs == L.LossInputs(actor_logprobs=True, values=True)
    # AReaL's defaults: discount 1, gae_lambda 1, the critic's eps_clip 0.5
    d = make_ppo()
    assert d.gae == GAE(1.0, 1.0) and d.loss.terms[1].loss.value_eps_clip == 0.5
    # the run config's algorithm: section builds it (no group_size: nothing is grouped)
    spec = AlgorithmSpec(name="ppo", kwargs={"gamma": 0.99, "gae_lambda": 0.95})
    assert spec.build().gae == GAE(0.99, 0.95)
    # the off-policy options and the aggregation reach the losses
    o = make_ppo(use_decoupled_loss=True, aggregation="seq-mean-token-mean")
    assert o.loss.terms[0].loss.off_policy.use_decoupled_loss and o.needs_prox_logprobs
    assert {t.loss.aggregation for t in o.loss.terms} == {"seq-mean-token-mean"}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"gamma": 1.5}, ValueError, r"GAE gamma=1.5 must be a number in \[0, 1\]"),
        ({"gae_lambda": -1}, ValueError, r"GAE gae_lambda=-1 must be a number in \[0, 1\]"),
        ({"value_eps_clip": 0}, ValueError, r"value_eps_clip=0 must be a number > 0"),
        ({"mask_no_eos_with_zero": True}, ValueError, r"ppo does not take mask_no_eos_with_zero"),
        ({"kl_coeff": 0.1}, TypeError, r"make_ppo\(\) got unexpected keyword.*kl_coeff"),
        ({"reward_norm": {"mean_level": "group"}}, TypeError, r"unexpected.*reward_norm"),
        ({"eps_clip": 1.5}, ValueError, r"eps_clip=1.5 must be in \[0, 1\)"),
    ],
)
def test_options_are_validated_with_the_fix(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        make_ppo(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma": 2}, r"algorithm 'ppo' with kwargs .*GAE gamma=2 must be"),
        ({"group_size": 4}, r"move it to algorithm.group_size"),
        ({"kl_coeff": 0.1}, r"\['kl_coeff'\] are not arguments of make_ppo"),
    ],
)
def test_the_run_configs_algorithm_section_refuses_them_too(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        AlgorithmSpec(name="ppo", kwargs=kwargs)


def test_a_critic_and_a_value_loss_come_together() -> None:
    pg = L.TokenClippedSurrogateLoss()
    with_value = L.CompositeLoss([L.LossTerm("pg", pg), L.LossTerm("value", ClippedValueLoss())])
    with pytest.raises(
        ValueError, match=r"reads a critic's values .* but the algorithm has no gae"
    ):
        RLAlgorithm("x", StepReward(), with_value)
    with pytest.raises(ValueError, match=r"has gae but its loss reads no critic values"):
        RLAlgorithm("x", StepReward(), pg, gae=GAE())
    with pytest.raises(ValueError, match=r"with gae the items' weights are step rewards"):
        RLAlgorithm("x", HybridNormalizedReturn(group_size=2), with_value, gae=GAE())


def test_items_carry_their_steps_shaped_reward_as_weight() -> None:
    # a three-step rollout rewarded 0, 0.5, 1.0, with reward_scaling 2: the weights are the
    # shaped step rewards 0, 1, 2 (the learner's GAE sums them); meta keeps the task's
    rs = [make_rollout("r", [0.0, 0.5, 1.0]), make_rollout("s", [-1.0])]
    items = make_ppo(reward_scaling=2.0).to_saw_items(rs)
    assert [(it.meta["rollout_id"], it.meta["step_index"], it.weight) for it in items] == [
        ("r", 0, 0.0),
        ("r", 1, 1.0),
        ("r", 2, 2.0),
        ("s", 0, -2.0),
    ]
    assert [it.meta["reward"] for it in items] == [1.5, 1.5, 1.5, -1.0]
    stamp = make_ppo(reward_scaling=2.0).fingerprint
    assert all(it.pending is None and it.credited_by == stamp for it in items)


class FixedRollouts:
    """An engine whose every call returns the same four one-step rollouts, each on a prompt
    of its own (so the critic can tell them apart), rewarded 1, 0, 1, 0.5; the completions'
    logprobs -5.5 are about the tiny model's (near uniform over 259 ids)."""

    async def generate_rollouts(self, requests, max_steps, concurrency=8):
        return [
            make_rollout(
                f"r{k}",
                [reward],
                prompt=(10 + k, 20 + 3 * k, 30),
                completion=(40 + 7 * k, 50, 60),
                logprobs=[-5.5] * 3,
            )
            for k, reward in enumerate([1.0, 0.0, 1.0, 0.5])
        ]


async def test_ppo_trains_in_process_the_value_loss_falls_and_both_models_move(
    tiny_model_dir,
) -> None:
    # RolloutBatchSource, the in-process path: the step's batch is one fixed batch repeated.
    # gamma = lambda = 1: the returns are the rewards at every token whatever V, and the
    # critic fits them step by step.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    algo = make_ppo()
    source = RolloutBatchSource(
        engine=FixedRollouts(),
        request_fn=lambda: [RolloutRequest(env=EnvSpec("arithmetic"), num_episodes=4)],
        algorithm=algo,
    )
    tr = Trainer(
        model=copy.deepcopy(model),
        algo=algo,
        batch_source=source,
        cfg=TrainerConfig(
            model_device="cpu",
            mixed_precision_dtype=None,
            pad_token_id=PAD_ID,
            lr=1e-3,
            critic_lr=1e-3,
        ),
    )
    assert tr.critic is not None
    policy0 = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    critic0 = {n: p.detach().clone() for n, p in tr.critic.model.named_parameters()}
    hist = await tr.train(num_steps=6)
    assert len(hist) == 6 and all(h["num_items"] == 4 for h in hist)
    value_loss = [h["loss/value/loss"] for h in hist]
    # at the start V = 0: 1/2 the token mean of R^2 = 1/2 (1 + 0 + 1 + 0.25) / 4 = 0.28125
    # (three action tokens each)
    assert value_loss[0] == pytest.approx(0.28125, rel=1e-5)
    assert all(b < a for a, b in zip(value_loss, value_loss[1:])), value_loss
    assert value_loss[-1] < 0.25 * value_loss[0]
    assert all(h["loss/value/return_mean"] == pytest.approx(0.625) for h in hist)
    assert all(h["critic_grad_norm"] > 0 and h["grad_norm"] > 0 for h in hist)
    moved = [n for n, p in tr.model.named_parameters() if not torch.equal(p, policy0[n])]
    assert len(moved) == len(policy0), "every policy parameter moves"
    c_moved = {n for n, p in tr.critic.model.named_parameters() if not torch.equal(p, critic0[n])}
    # the head, and through it the backbone (its gradient is 0 while the head is 0)
    assert {"value_head.weight", "value_head.bias"} <= c_moved
    assert any(n.startswith("backbone.layers.") for n in c_moved)
