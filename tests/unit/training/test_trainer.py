"""Trainer on the tiny model: exact micro-batch accumulation, max_lag, publishing, learning."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training import loss as L
from libludic.training.algorithm import RLAlgorithm
from libludic.training.config import TrainerConfig
from libludic.training.credit_assignment import ConstantCredit
from libludic.training.loss import (
    CISPOLoss,
    GSPOLoss,
    OffPolicyCorrection,
    ReinforceBaselineLoss,
    ReinforceLoss,
    TokenClippedSurrogateLoss,
)
from libludic.training.presets import make_grpo, make_sft
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource, make_item, ticks_during


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def cpu_cfg(**kw) -> TrainerConfig:
    return TrainerConfig(model_device="cpu", mixed_precision_dtype=None, pad_token_id=PAD_ID, **kw)


def varied_items():
    shapes = [(5, 3, 1.0), (9, 6, -0.5), (3, 2, 2.0), (12, 4, 0.3), (4, 7, -1.2), (6, 1, 0.7)]
    return [make_item(s, a, weight=w, seed=i) for i, (s, a, w) in enumerate(shapes)]


def off_policy_items():
    """varied_items whose behaviour logprobs alternate -2.5 / -8.5 around the tiny model's
    ~ -5.6 (near-uniform over 259 ids): rho ~ e^-3 and e^3 (= 20, above any cap below), so
    tokens and sequences are truncated / dropped on both sides of micro-batch boundaries."""
    items = varied_items()
    for it in items:
        n_state = it.num_tokens - it.num_action_tokens
        acts = [-2.5 if i % 2 else -8.5 for i in range(it.num_action_tokens)]
        it.attachments.actor_logprobs = [0.0] * n_state + acts
    return items


@pytest.mark.parametrize(
    "loss, items_fn",
    [
        (ReinforceLoss(), varied_items),
        (ReinforceLoss(aggregation="sequence"), varied_items),
        (ReinforceBaselineLoss(), varied_items),
        (TokenClippedSurrogateLoss(eps_clip=0.2), varied_items),
        (CISPOLoss(), varied_items),
        (
            TokenClippedSurrogateLoss(off_policy=OffPolicyCorrection("tis", "token", 2.0)),
            off_policy_items,
        ),
        (
            TokenClippedSurrogateLoss(off_policy=OffPolicyCorrection("mis", "sequence", 2.0)),
            off_policy_items,
        ),
        (CISPOLoss(off_policy=OffPolicyCorrection("mis", "token", 2.0)), off_policy_items),
        (CISPOLoss(off_policy=OffPolicyCorrection("tis", "sequence", 1.5)), off_policy_items),
        (
            TokenClippedSurrogateLoss(
                off_policy=OffPolicyCorrection(use_decoupled_loss=True, behav_imp_weight_cap=5.0)
            ),
            off_policy_items,
        ),
        (
            TokenClippedSurrogateLoss(off_policy=OffPolicyCorrection(recompute_logprob=True)),
            off_policy_items,
        ),
        (CISPOLoss(off_policy=OffPolicyCorrection(use_decoupled_loss=True)), off_policy_items),
        (ReinforceLoss(aggregation="seq-mean-token-sum"), varied_items),
        (
            ReinforceBaselineLoss(aggregation="seq-mean-token-sum-norm", max_new_tokens=16),
            varied_items,
        ),
        (
            TokenClippedSurrogateLoss(aggregation="seq-mean-token-sum-norm", max_new_tokens=16),
            varied_items,
        ),
        (CISPOLoss(aggregation="seq-mean-token-sum"), varied_items),
        (GSPOLoss(eps_clip=0.2, eps_clip_higher=0.2), varied_items),
        (
            GSPOLoss(
                aggregation="token-mean",
                off_policy=OffPolicyCorrection(use_decoupled_loss=True, behav_imp_weight_cap=5.0),
            ),
            off_policy_items,
        ),
        (GSPOLoss(off_policy=OffPolicyCorrection("mis", "sequence", 2.0)), off_policy_items),
    ],
    ids=[
        "reinforce",
        "reinforce-seq",
        "baseline",
        "clipped",
        "cispo",
        "clipped-tis-token",
        "clipped-mis-seq",
        "cispo-mis-token",
        "cispo-tis-seq",
        "decoupled-cap",
        "recompute",
        "cispo-decoupled",
        "reinforce-seq-sum",
        "baseline-seq-sum-norm",
        "dr-grpo",
        "cispo-seq-sum",
        "gspo",
        "gspo-decoupled-token-mean",
        "gspo-mis-seq",
    ],
)
def test_micro_batched_gradient_equals_full_batch(base_model, loss, items_fn) -> None:
    algo = RLAlgorithm("t", ConstantCredit(), loss)
    items = items_fn()
    full = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        batch_source=ListBatchSource([items]),
        cfg=cpu_cfg(micro_token_budget=10_000),
    )
    micro = Trainer(
        model=copy.deepcopy(base_model),
        algo=algo,
        batch_source=ListBatchSource([items]),
        cfg=cpu_cfg(micro_token_budget=24),
    )
    s_full = full.accumulate_gradients(items)
    s_micro = micro.accumulate_gradients(items)
    assert s_full["num_micro_batches"] == 1 and s_micro["num_micro_batches"] >= 4
    # sum of micro losses == full-batch loss, and so are the gradients
    assert s_micro["loss"] == pytest.approx(s_full["loss"], rel=1e-5, abs=1e-6)
    for (n, p), q in zip(full.model.named_parameters(), micro.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    # every loss stat combined over micro-batches is the full batch's: the token-weighted mean
    # of per-token means (entropy, ratio_mean, ...), the max of maxima (ratio_max, ...)
    loss_keys = {k for k in s_full if k.startswith("loss/")}
    assert (
        loss_keys
        == {f"loss/{k}" for k in loss.stat_keys if k != "loss"}
        == {k for k in s_micro if k.startswith("loss/")}
    )
    for k in loss_keys:
        assert s_micro[k] == pytest.approx(s_full[k], rel=1e-4, abs=1e-6), k
    if items_fn is off_policy_items:
        if loss.off_policy.mismatch_correction or loss.off_policy.behav_imp_weight_cap:
            # the correction does something on these items: some tokens are capped, not all
            assert 0.0 < s_full["loss/mismatch_capped_frac"] < 1.0


class SpyLoss:
    """Wraps a loss; keeps every batch it is given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches = []

    @property
    def requires(self) -> L.LossInputs:
        return L.loss_inputs(self.inner)

    def compute(self, logits, batch):
        self.batches.append(dict(batch))
        return self.inner.compute(logits, batch)


@pytest.mark.parametrize(
    "flags, wanted",
    [({}, False), ({"recompute_logprob": True}, True), ({"use_decoupled_loss": True}, True)],
    ids=["off", "recompute", "decoupled"],
)
def test_prox_logprobs_are_a_no_grad_forward_of_the_current_weights_only_when_asked(
    base_model, flags, wanted
) -> None:
    items = [
        sampled_at(base_model, make_item(s, a, weight=w, seed=i), 0.7)
        for i, (s, a, w) in enumerate([(5, 3, 1.0), (9, 6, -0.5), (3, 4, 0.5), (6, 2, 1.5)])
    ]
    spy = SpyLoss(TokenClippedSurrogateLoss(off_policy=OffPolicyCorrection(**flags)))
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=RLAlgorithm("t", ConstantCredit(), spy),
        batch_source=ListBatchSource([]),
        cfg=cpu_cfg(micro_token_budget=24),
    )
    assert tr.algo.needs_prox_logprobs == wanted
    tr.model.train()
    st = tr.accumulate_gradients(items)
    assert tr.model.training  # the eval-mode forward hands the model back in train mode
    assert st["num_micro_batches"] > 1 and ("prox_time_s" in st) == wanted
    for b in spy.batches:
        assert (L.PROX_LOGPROBS_KEY in b) == wanted
        if wanted:  # the weights before the update (no step happened), at the item's temperature
            with torch.no_grad():
                out = base_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            want = L.token_logprobs(L.apply_temperature(out.logits.float(), b), b["input_ids"])
            torch.testing.assert_close(b[L.PROX_LOGPROBS_KEY][:, 1:], want)
            assert not b[L.PROX_LOGPROBS_KEY][:, 0].any()
    # on-policy items: prox = the server's logprobs, so r = 1, w = 1 and the gap is 0
    assert st["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert st["loss/mismatch_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert st["loss/mismatch_logprob_gap"] == pytest.approx(0.0, abs=1e-5)


class RecordingPublisher:
    def __init__(self) -> None:
        self.versions = []
        self.keys = None

    def publish(self, state_dict, version) -> None:
        self.versions.append(version)
        self.keys = sorted(state_dict)


async def test_max_lag_drops_and_counts_stale_items(base_model) -> None:
    fresh = [make_item(4, 2, seed=i, policy_version=0) for i in range(2)]
    mixed = [make_item(4, 2, seed=10 + v, policy_version=v) for v in (0, 1, 2)]
    pub = RecordingPublisher()
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_sft(),
        batch_source=ListBatchSource([fresh, fresh, mixed]),
        publisher=pub,
        cfg=cpu_cfg(max_lag=1, lr=1e-3, async_publish=False),
    )
    await tr.train(num_steps=2)
    assert tr.policy_version == 2 and pub.versions == [1, 2]
    # the tied head is the embedding: published once, under the embedding's name
    assert base_model.config.tie_word_embeddings
    assert "model.embed_tokens.weight" in pub.keys and "lm_head.weight" not in pub.keys
    stats = await tr.train_step()
    # current version 2, max_lag 1: keep v >= 1 -> the v=0 item is dropped
    assert stats["stale_dropped"] == 1 and stats["num_items"] == 2
    assert stats["stale_dropped_total"] == 1
    assert pub.versions == [1, 2, 3]
    for k in (
        "loss",
        "grad_norm",
        "lr",
        "num_items",
        "num_tokens",
        "reward_mean",
        "stale_dropped",
        "samples_per_s",
        "tokens_per_s",
    ):
        assert k in stats


async def test_all_stale_batch_makes_no_update(base_model) -> None:
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_sft(),
        batch_source=ListBatchSource([[make_item(4, 2, policy_version=0)]]),
        cfg=cpu_cfg(max_lag=0),
    )
    tr.publishing.restore(5)  # inference serves v5
    before = [p.detach().clone() for p in tr.model.parameters()]
    stats = await tr.train_step()
    assert stats["num_items"] == 0 and stats["stale_dropped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))


class StatLoss:
    """Zero loss whose stats are the credit weight's mean over a micro-batch's action tokens
    and its max: shows how the Trainer combines the micro-batches' stats."""

    stat_keys = ("loss", "w_mean", "w_max")

    def compute(self, logits, batch):
        m = L.token_mask(batch, logits.dtype)
        w = batch["weight"].to(logits.dtype).unsqueeze(-1)  # [B, 1]
        loss = (logits * 0.0).sum()
        return loss, {
            "loss": loss.detach(),
            "w_mean": L.masked_mean(w.expand_as(m), m),
            "w_max": L.masked_max(w, m),
        }


def test_micro_batch_stats_combine_by_token_weighted_mean_and_max_keys_by_max(base_model) -> None:
    # 5 tokens per item, 5 padded tokens per micro-batch: one item in each of 2 micro-batches;
    # weight 3 on 3 action tokens, weight -1 on 1 action token
    items = [make_item(2, 3, weight=3.0, seed=0), make_item(4, 1, weight=-1.0, seed=1)]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=RLAlgorithm("t", ConstantCredit(), StatLoss()),
        batch_source=ListBatchSource([]),
        cfg=cpu_cfg(micro_token_budget=5),
    )
    st = tr.accumulate_gradients(items)
    assert st["num_micro_batches"] == 2 and st["num_action_tokens"] == 4
    # w_mean: token-weighted (3 * 3 + 1 * -1) / 4 = 2, the mean over the batch's 4 tokens
    assert st["loss/w_mean"] == pytest.approx(2.0)
    # w_max: max(3, -1) = 3; the token-weighted mean of the two maxima would be 2
    assert st["loss/w_max"] == 3.0


async def test_adv_mean_and_std_are_the_batchs_weight_mean_and_population_std(base_model) -> None:
    from services.learner.metrics import STEP_SIGNALS

    four = [make_item(3, 2, weight=w, seed=i) for i, w in enumerate((1.0, 2.0, 3.0, 6.0))]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=RLAlgorithm("t", ConstantCredit(), ReinforceLoss()),
        batch_source=ListBatchSource([four, [make_item(3, 2, weight=-0.5, seed=9)]]),
        cfg=cpu_cfg(micro_token_budget=10),  # 2 items (5 tokens each) per micro-batch
    )
    st = await tr.train_step()
    assert st["num_micro_batches"] == 2
    # one value per item, whatever the micro-batches: mean (1 + 2 + 3 + 6) / 4 = 3;
    # deviations -2, -1, 0, 3: population variance (4 + 1 + 0 + 9) / 4 = 3.5, std 1.871
    assert st["adv_mean"] == pytest.approx(3.0)
    assert st["adv_std"] == pytest.approx(math.sqrt(3.5))
    assert set(STEP_SIGNALS) <= set(st)  # what the learner exports as train signals
    st = await tr.train_step()
    # one item: the mean is its weight -0.5, the std 0
    assert st["adv_mean"] == -0.5 and st["adv_std"] == 0.0


async def test_a_non_finite_gradient_skips_the_update_and_training_goes_on(base_model) -> None:
    poisoned = varied_items()
    poisoned[2].weight = float("inf")  # inf * logprob gradient: inf/NaN gradients everywhere
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=RLAlgorithm("t", ConstantCredit(), ReinforceLoss()),
        batch_source=ListBatchSource([poisoned, varied_items()]),
        cfg=cpu_cfg(lr=1e-2),
    )
    before = [p.detach().clone() for p in tr.model.parameters()]
    stats = await tr.train_step()
    assert not torch.isfinite(torch.tensor(stats["grad_norm"]))
    assert stats["nonfinite_skipped_total"] == 1 and tr.nonfinite_skipped_total == 1
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))
    assert not tr.optimizer.state  # AdamW's moments never saw the NaN
    assert all(p.grad is None for p in tr.model.parameters())
    stats = await tr.train_step()  # a clean batch trains as usual
    assert stats["nonfinite_skipped_total"] == 1
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))


async def test_a_step_runs_off_the_event_loop(base_model) -> None:
    """The service's /health, /metrics and heartbeats share the loop: a long step must not
    block it. A loss that takes 0.4 s per micro-batch; a ticker on the loop keeps ticking."""
    import time

    class SlowLoss(ReinforceLoss):
        def compute(self, logits, batch):  # type: ignore[override]
            time.sleep(0.4)
            return super().compute(logits, batch)

    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=RLAlgorithm("t", ConstantCredit(), SlowLoss()),
        batch_source=ListBatchSource([varied_items()]),
        cfg=cpu_cfg(micro_token_budget=10_000),
    )
    before = tr.last_progress
    _, ticks = await ticks_during(tr.train_step(), 0.05)
    assert ticks >= 4  # ~8 in 0.4 s; 0 if the step held the loop
    assert tr.last_progress > before


async def test_a_few_steps_lower_the_loss(base_model) -> None:
    items = [make_item(6, 4, seed=i) for i in range(8)]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_sft(),
        batch_source=ListBatchSource([items]),
        cfg=cpu_cfg(lr=3e-3, micro_token_budget=40),
    )
    hist = await tr.train(num_steps=8)
    # initial NLL ~ log(259) = 5.56; memorising 8 fixed sequences must go well below it
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.5
    assert all(h["grad_norm"] > 0 for h in hist)


async def test_grpo_requires_actor_logprobs(base_model) -> None:
    items = [make_item(4, 2, logprobs=False)]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_grpo(group_size=1),
        batch_source=ListBatchSource([items]),
        cfg=cpu_cfg(),
    )
    with pytest.raises(ValueError, match=r"needs actor logprobs.*ReturnSpec.for_rl"):
        await tr.train_step()


def sampled_at(model, item, temp):
    """``item`` with actor_logprobs = log_softmax(logits / temp) of its own action tokens
    (what the server returns for tokens it sampled at ``temp``) and that temperature."""
    ids = torch.tensor([item.input_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float() / temp, -1)[0]
    n = len(item.input_ids)
    actor = [0.0] + [float(lp[t - 1, item.input_ids[t]]) for t in range(1, n)]
    item.attachments.actor_logprobs = [a * m for a, m in zip(actor, item.action_mask)]
    item.attachments.temperature = temp
    return item


@pytest.mark.parametrize("temp", [0.6, 1.3])
def test_onpolicy_ratio_is_one_at_the_items_temperature(base_model, temp) -> None:
    """Items sampled at T carry T; the trainer divides their logits by T, so the PPO ratio of
    an on-policy step is exactly 1 (approx_kl 0). The same items read at T=1 (temperature
    dropped) are off: that is what the trainer did before items carried their temperature."""
    items = [
        sampled_at(base_model, make_item(s, a, weight=w, seed=i), temp)
        for i, (s, a, w) in enumerate([(5, 3, 1.0), (9, 6, -0.5), (3, 4, 0.5)])
    ]
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_grpo(group_size=1),
        batch_source=ListBatchSource([]),
        cfg=cpu_cfg(micro_token_budget=16),
    )
    st = tr.accumulate_gradients(items)
    assert st["num_micro_batches"] > 1  # the temperature follows each item across micro-batches
    assert st["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert st["loss/approx_kl"] == pytest.approx(0.0, abs=1e-10)
    for it in items:
        it.attachments.temperature = None
    st = tr.accumulate_gradients(items)
    assert st["loss/approx_kl"] > 1e-4  # measured 9.7e-4 at T=1.3 on the near-uniform tiny model


def test_greedy_items_train_untempered(base_model) -> None:
    """T = 0 (greedy): vLLM returns untempered logprobs, so the trainer uses T = 1."""
    it = sampled_at(base_model, make_item(5, 3, seed=1), 1.0)
    it.attachments.temperature = 0.0
    assert it.attachments.train_temperature == 1.0
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_grpo(group_size=1),
        batch_source=ListBatchSource([]),
        cfg=cpu_cfg(),
    )
    assert tr.accumulate_gradients([it])["loss/approx_kl"] == pytest.approx(0.0, abs=1e-10)


def test_cuda_default_falls_back_to_cpu(base_model) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: no fallback")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        tr = Trainer(
            model=copy.deepcopy(base_model),
            algo=make_sft(),
            batch_source=ListBatchSource([[make_item(3, 1)]]),
            cfg=TrainerConfig(),
        )
    assert tr.device.type == "cpu" and tr.stepper._amp_dtype is None  # no CPU autocast by default


async def test_lora_trains_adapters_and_publishes_merged_hf_names(base_model) -> None:
    pub = RecordingPublisher()
    tr = Trainer(
        model=copy.deepcopy(base_model),
        algo=make_sft(),
        batch_source=ListBatchSource([[make_item(6, 4, seed=i) for i in range(4)]]),
        publisher=pub,
        cfg=cpu_cfg(lora_rank=4, lr=1e-2),
    )
    assert all("lora_" in n for n, p in tr.model.named_parameters() if p.requires_grad)
    await tr.train(num_steps=2)
    sd = tr.full_state_dict()
    assert sorted(sd) == sorted(set(base_model.state_dict()) - {"lm_head.weight"})  # tied
    q = "model.layers.0.self_attn.q_proj.weight"
    # B starts at zero, so a change of the merged weight proves the delta is merged in
    assert not torch.allclose(sd[q], base_model.state_dict()[q])
    assert pub.keys == sorted(sd)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="lr"):
        TrainerConfig(lr=0)
    with pytest.raises(ValueError, match="max_lag"):
        TrainerConfig(max_lag=-1)
    with pytest.raises(ValueError, match="mixed_precision_dtype"):
        TrainerConfig(mixed_precision_dtype="int8")
    with pytest.raises(ValueError, match="model_device"):
        TrainerConfig(model_device="gpu0")
    c = TrainerConfig()
    assert (c.model_device, c.lr, c.weight_decay, c.betas, c.eps, c.max_grad_norm) == (
        "cuda",
        1e-5,
        0.01,
        (0.9, 0.999),
        1e-8,
        1.0,
    )
    assert (c.max_seq_len, c.micro_token_budget, c.sync_every_steps, c.mixed_precision_dtype) == (
        1024,
        8192,
        1,
        "bf16",
    )
    assert (c.cast_logits_to_fp32, c.max_lag, c.log_every, c.pad_token_id) == (True, None, 1, 0)
    assert (c.eval_at_start, c.eval_every_n_steps, c.eval_concurrency, c.runtime_device) == (
        False,
        None,
        32,
        None,
    )
