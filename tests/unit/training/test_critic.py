"""The Trainer's critic (libludic/training/critic.py, step.py) on the tiny model: where the
values, GAE's advantages and returns land on the shifted grid, a rollout joined across
micro-batches, exact micro-batch accumulation of both models' gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training import loss as L
from libludic.training import parallel
from libludic.training.algorithm import RLAlgorithm
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import ConstantCredit, StepReward
from libludic.training.critic import ValueModel
from libludic.training.gae import GAE
from libludic.training.trainer import Trainer
from libludic.training.value_loss import OLD_VALUES_KEY, RETURNS_KEY, VALUES_KEY, ClippedValueLoss
from tests.fakes import ListBatchSource, make_item


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def cpu_cfg(**kw) -> TrainerConfig:
    return TrainerConfig(model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, **kw)


class SpyLoss:
    """Wraps a loss; keeps every batch it is given (the tensors as they were then)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list[dict] = []

    @property
    def requires(self) -> L.LossInputs:
        return L.loss_inputs(self.inner)

    def compute(self, logits, batch):
        self.batches.append(
            {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        )
        return self.inner.compute(logits, batch)


def ppo_algo(gamma: float = 1.0, lam: float = 1.0, spy: bool = True) -> RLAlgorithm:
    loss = L.CompositeLoss(
        [L.LossTerm("pg", L.TokenClippedSurrogateLoss()), L.LossTerm("value", ClippedValueLoss())]
    )
    return RLAlgorithm(
        "ppo-test", StepReward(), SpyLoss(loss) if spy else loss, gae=GAE(gamma, lam)
    )


def step(rollout: str, index: int, n_state: int, n_action: int, reward: float, seed: int):
    it = make_item(n_state, n_action, weight=reward, seed=seed)
    it.meta.update(rollout_id=rollout, step_index=index, item_id=f"{rollout}:{index}")
    return it


def bare_trainer(base_model, algo: RLAlgorithm, **cfg) -> Trainer:
    """A Trainer over a copy of the tiny model and no batches: the test drives its steps."""
    return Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        batch_source=ListBatchSource([]),
        cfg=cpu_cfg(**cfg),
    )


def action_rows(b: dict) -> list[torch.Tensor]:
    """Each row's action positions on the shifted grid."""
    on = L.token_mask(b, torch.float32) > 0
    return [on[j] for j in range(on.shape[0])]


def test_first_step_advantages_are_the_discounted_rewards_on_the_action_tokens(
    base_model,
) -> None:
    # The value head starts at zero, so V_old = 0 at every token and delta_t = r_t:
    # A_t = sum_l (gamma lambda)^l r_{t+l}. gamma 0.5, lambda 1, one item of 4 action tokens
    # rewarded 2.0: A = [0.25, 0.5, 1, 2] (0.5^3 * 2, ...), R = A + 0 = A.
    algo = ppo_algo(gamma=0.5, lam=1.0)
    tr = bare_trainer(base_model, algo)
    st = tr.accumulate_gradients([step("a", 0, 5, 4, 2.0, 1)])
    (b,) = algo.loss.batches
    (on,) = action_rows(b)
    assert int(on.sum()) == 4 and not b[L.ADVANTAGES_KEY][0][~on].any()
    torch.testing.assert_close(b[L.ADVANTAGES_KEY][0][on], torch.tensor([0.25, 0.5, 1.0, 2.0]))
    torch.testing.assert_close(b[RETURNS_KEY][0][on], torch.tensor([0.25, 0.5, 1.0, 2.0]))
    assert not b[OLD_VALUES_KEY].any()
    # the values in the loss are the critic's forward, with grad: 0 at the start too
    assert b[VALUES_KEY].shape == b[L.ADVANTAGES_KEY].shape and not b[VALUES_KEY].any()
    # the step's advantages: token mean and population std of [0.25, 0.5, 1, 2]
    mean = 3.75 / 4
    std = (sum(a * a for a in (0.25, 0.5, 1.0, 2.0)) / 4 - mean**2) ** 0.5
    assert st["adv_mean"] == pytest.approx(mean) and st["adv_std"] == pytest.approx(std)
    assert "value_time_s" in st


def test_a_rollouts_steps_are_one_episode_across_micro_batches(base_model) -> None:
    # Rollout "r": step 0 (3 action tokens, reward 0.5) and step 1 (2 action tokens, reward
    # 1.0), each in a micro-batch of its own (budget 12 tokens), beside rollout "s" (one step,
    # reward -1.0). gamma = lambda = 1 and V = 0: A_t = the rewards still to come,
    #   r:0 -> [1.5, 1.5, 1.5] (0.5 + 1.0),  r:1 -> [1.0, 1.0],  s:0 -> [-1, -1, -1, -1]
    algo = ppo_algo()
    items = [step("r", 1, 4, 2, 1.0, 2), step("s", 0, 4, 4, -1.0, 3), step("r", 0, 6, 3, 0.5, 4)]
    tr = bare_trainer(base_model, algo, micro_token_budget=12)
    st = tr.accumulate_gradients(items)
    assert st["num_micro_batches"] == 3
    got = sorted(
        tuple(round(float(x), 6) for x in b[L.ADVANTAGES_KEY][j][on])
        for b in algo.loss.batches
        for j, on in enumerate(action_rows(b))
    )
    assert got == [(-1.0,) * 4, (1.0, 1.0), (1.5, 1.5, 1.5)]


def test_old_values_are_the_critics_no_grad_forward_before_the_update(base_model) -> None:
    # a critic that already learned something: head weight and bias not 0
    algo = ppo_algo(gamma=1.0, lam=0.0)
    tr = bare_trainer(base_model, algo)
    assert tr.critic is not None
    head = tr.critic.model.value_head
    with torch.no_grad():
        head.weight.normal_(0.0, 0.1)
        head.bias.fill_(0.25)
    item = step("a", 0, 5, 3, 1.0, 5)
    ids = torch.tensor([item.input_ids])
    with torch.no_grad():
        want = tr.critic.model(ids, torch.ones_like(ids))[0, :-1]  # [T-1], the shifted grid
    tr.accumulate_gradients([item])
    (b,) = algo.loss.batches
    (on,) = action_rows(b)
    torch.testing.assert_close(b[OLD_VALUES_KEY][0][on], want[on])
    torch.testing.assert_close(b[VALUES_KEY][0], want)  # no update yet: the same weights
    # lambda 0: A_t = r_t + V_{t+1} - V_t, V after the last action token 0
    v = want[on]
    r = torch.tensor([0.0, 0.0, 1.0])
    torch.testing.assert_close(
        b[L.ADVANTAGES_KEY][0][on], r + torch.cat([v[1:], v.new_zeros(1)]) - v
    )


def test_micro_batched_gradients_of_policy_and_critic_equal_the_full_batch(base_model) -> None:
    items = [
        step("a", 0, 5, 3, 1.0, 0),
        step("a", 1, 9, 6, -0.5, 1),
        step("b", 0, 3, 2, 2.0, 2),
        step("c", 0, 12, 4, 0.3, 3),
    ]
    trainers = []
    for budget in (10_000, 20):
        tr = bare_trainer(base_model, ppo_algo(spy=False), micro_token_budget=budget)
        with torch.no_grad():  # a critic whose values are not all 0
            tr.critic.model.value_head.weight.normal_(
                0.0, 0.1, generator=torch.Generator().manual_seed(0)
            )
        trainers.append((tr, tr.accumulate_gradients(items)))
    (full, s_full), (micro, s_micro) = trainers
    assert s_full["num_micro_batches"] == 1 and s_micro["num_micro_batches"] >= 3
    assert s_micro["loss"] == pytest.approx(s_full["loss"], rel=1e-5, abs=1e-6)
    for a, b in ((full.model, micro.model), (full.critic.model, micro.critic.model)):
        for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert p.grad is not None, n
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    # (a term's own "loss" stat is each micro-batch's share of it, not a mean: left out)
    for k in ("loss/value/value_mean", "loss/value/return_mean", "adv_mean", "adv_std"):
        assert s_micro[k] == pytest.approx(s_full[k], rel=1e-4, abs=1e-6), k


def test_a_step_moves_both_models_and_publishes_the_policy_alone(base_model) -> None:
    import asyncio

    class Pub:
        keys: list[str] = []

        def publish(self, state_dict, version) -> None:
            Pub.keys = sorted(state_dict)

    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=ppo_algo(spy=False),
        batch_source=ListBatchSource([[step("a", 0, 5, 3, 1.0, 0), step("b", 0, 4, 2, 0.0, 1)]]),
        publisher=Pub(),
        cfg=cpu_cfg(lr=1e-3, critic_lr=1e-2, async_publish=False),
    )
    assert tr.critic is not None
    before = [p.detach().clone() for p in tr.critic.params]
    head = tr.critic.model.value_head.bias
    (st,) = asyncio.run(tr.train(num_steps=1))
    assert st["critic_grad_norm"] > 0 and st["grad_norm"] > 0
    # the critic's own optimizer at critic_lr: Adam's first step moves each parameter with
    # a gradient by ~lr, here the head's bias by 1e-2
    assert abs(float(head.detach()) - float(before[-1])) == pytest.approx(1e-2, rel=1e-3)
    assert tr.critic.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    assert Pub.keys == sorted(state_keys(base_model))  # nothing of the critic is published


def state_keys(model: nn.Module) -> list[str]:
    seen, out = set(), []
    for k, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(k)
    return out


def test_value_model_needs_a_transformers_backbone_or_a_given_critic(base_model) -> None:
    with pytest.raises(ValueError, match=r"cannot build a critic from Linear.*critic_model="):
        ValueModel.from_policy(nn.Linear(2, 2))
    vm = ValueModel.from_policy(base_model)
    # FSDP2 shards the critic's decoder layers one by one, as the policy's
    assert set(vm._no_split_modules) == set(base_model.model._no_split_modules)
    assert len(parallel.decoder_layers(vm)) == base_model.config.num_hidden_layers
    assert not vm.value_head.weight.any() and not vm.value_head.bias.any()


def test_a_critic_model_for_an_algorithm_without_one_is_refused(base_model) -> None:
    with pytest.raises(ValueError, match=r"critic_model given but algorithm 'c' trains no critic"):
        Trainer(
            model=copy.deepcopy(base_model),
            algo=RLAlgorithm("c", ConstantCredit(), L.ReinforceLoss()),
            batch_source=ListBatchSource([]),
            cfg=cpu_cfg(),
            critic_model=ValueModel.from_policy(base_model),
        )


def test_a_given_critic_model_is_the_one_trained(base_model) -> None:
    mine = ValueModel.from_policy(base_model)
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=ppo_algo(spy=False),
        batch_source=ListBatchSource([]),
        cfg=cpu_cfg(),
        critic_model=mine,
    )
    assert tr.critic is not None and tr.critic.model is mine


def ppo_trainer(base_model, ck_dir=None, every: int = 0, algo=None) -> Trainer:
    from libludic.training.checkpoint import CheckpointConfig, CheckpointManager

    batches = [
        [step("a", 0, 5, 3, 1.0, 0), step("a", 1, 4, 2, 0.5, 1), step("b", 0, 3, 4, 0.0, 2)],
        [step("c", 0, 6, 2, -1.0, 3), step("d", 0, 4, 3, 1.0, 4)],
    ]
    mgr = None if ck_dir is None else CheckpointManager(CheckpointConfig(str(ck_dir), every))
    return Trainer(
        model=copy.deepcopy(base_model),
        algo=algo if algo is not None else ppo_algo(gamma=0.9, lam=0.8, spy=False),
        batch_source=ListBatchSource(batches),
        cfg=cpu_cfg(lr=1e-2, critic_lr=1e-2),
        checkpointer=mgr,
    )


async def test_a_ppo_resume_restores_the_critic_bit_for_bit(base_model, tmp_path) -> None:
    straight = ppo_trainer(base_model)
    await straight.train(num_steps=4)
    first = ppo_trainer(base_model, tmp_path / "ck", every=2)
    await first.train(num_steps=2)
    step_dir = tmp_path / "ck" / "step_000000002"
    assert (step_dir / "critic.safetensors").exists()
    assert (step_dir / "critic_optimizer.safetensors").exists()
    resumed = ppo_trainer(base_model, tmp_path / "ck")
    ck = resumed.load_checkpoint()
    assert ck is not None and ck.step == 2 and set(ck.parts) == {"critic"}
    await resumed.train(num_steps=2)
    assert straight.critic is not None and resumed.critic is not None
    for a, b in ((straight.model, resumed.model), (straight.critic.model, resumed.critic.model)):
        for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), n
    sa, sb = straight.critic.optimizer.state_dict(), resumed.critic.optimizer.state_dict()
    for pid in sa["state"]:
        for k, v in sa["state"][pid].items():
            assert torch.equal(v, sb["state"][pid][k]), (pid, k)


async def test_a_checkpoint_without_a_critic_is_refused_by_ppo(base_model, tmp_path) -> None:
    from libludic.training.presets import make_sft

    sft = ppo_trainer(base_model, tmp_path / "ck", every=1, algo=make_sft())
    await sft.train(num_steps=1)
    with pytest.raises(ValueError, match=r"holds no critic: it was saved by a Trainer that"):
        ppo_trainer(base_model, tmp_path / "ck").load_checkpoint()


def test_minibatches_share_the_advantages_taken_before_the_first_update(base_model) -> None:
    # ppo_n_minibatches 2 (items 0-1 and 2-3): GAE runs once, over the whole step, with the
    # critic's values before either update. Rollout "a" straddles the two minibatches.
    algo = ppo_algo(gamma=0.9, lam=0.9)
    items = [
        step("b", 0, 3, 4, 0.0, 2),
        step("a", 1, 4, 2, 0.5, 1),
        step("a", 0, 5, 3, 1.0, 0),
        step("c", 0, 6, 2, -1.0, 3),
    ]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        batch_source=ListBatchSource([items]),
        cfg=cpu_cfg(lr=1e-2, critic_lr=1e-2, ppo_n_minibatches=2),
    )
    assert tr.critic is not None
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        tr.critic.model.value_head.weight.normal_(0.0, 0.1, generator=g)
    before = copy.deepcopy(tr.critic.model).eval()
    st = tr.stepper.update(items, 0)
    assert st["num_minibatches"] == 2 and len(algo.loss.batches) == 2
    assert st["critic_grad_norm"] > 0
    # what GAE gives the whole step with `before`'s values
    values = []
    for it in items:
        ids = torch.tensor([it.input_ids])
        with torch.no_grad():
            v = before(ids, torch.ones_like(ids))[0, :-1]
        values.append(v[torch.tensor(it.action_mask[1:]) > 0])
    want = sorted(
        tuple(round(float(x), 5) for x in adv) for adv, _ in algo.gae.per_item(items, values)
    )
    got = sorted(
        tuple(round(float(x), 5) for x in b[L.ADVANTAGES_KEY][j][on])
        for b in algo.loss.batches
        for j, on in enumerate(action_rows(b))
    )
    assert got == want
    # the second minibatch trains a critic the first one moved: its values are not V_old
    last = algo.loss.batches[-1]
    on = L.token_mask(last, torch.float32) > 0
    assert not torch.allclose(last[VALUES_KEY][on], last[OLD_VALUES_KEY][on])
