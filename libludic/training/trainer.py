"""Trainer: SAWBatch -> micro-batches -> gradients -> AdamW step -> publish.

One optimizer step (``train_step``):

1. ``batch_source.next_batch()`` gives the macro-batch.
2. Stale items are dropped (``max_lag``, decided by ``libludic.staleness``): an item sampled
   by policy version v is kept iff ``v >= policy_version - max_lag`` (items without a
   version are kept); ``policy_version`` is the last version a publish acknowledged.
3. Items are packed into micro-batches of at most ``micro_token_budget`` padded tokens.
4. Every micro-batch is forwarded and backpropagated. **Exactness of accumulation:** the
   losses are sums over tokens (or sequences) divided by a normaliser N; the trainer
   computes N over the whole macro-batch (and over all ranks) and passes it in the batch
   (``loss.NUM_ACTION_TOKENS_KEY`` / ``NUM_SEQUENCES_KEY``, plus the macro weight mean for
   baselines), so each micro loss is its *share* of the full-batch loss and the
   accumulated gradient equals the full-batch gradient up to float rounding. Under FSDP2
   the loss is multiplied by world_size because the reduce-scatter averages gradients.
5. Gradients are clipped to ``max_grad_norm``, AdamW steps; a non-finite gradient norm skips
   the update (counted in ``nonfinite_skipped_total``, weights and optimizer state unchanged).
6. The batch source's items are marked trained (``mark_trained()``, when it has one).
7. Every ``sync_every_steps`` steps the weights are published (``start_publish()``: the
   full state dict gathered and copied, a snapshot training may change the live weights
   under) through ``self.publishing`` (libludic/training/publishing.py: the one version
   counter, double buffering and the failure policy). With ``cfg.async_publish`` (default)
   the next step trains while it is sent. ``policy_version`` is the last version a publish
   *acknowledged*: what inference serves; staleness and the admission of new episodes are
   measured against it. ``publish_wait_s`` in the step stats is the time the step spent on
   publishing (snapshot plus waiting for the previous publish); without ``async_publish``
   it is the whole send.
8. Every ``eval_every_n_steps``, the evaluator; then the checkpoint when
   ``checkpointer.should_save(step)`` (after which the batch source's trained items are
   committed: ``commit()``, when it has one, so an item is committed iff it is inside a saved
   checkpoint), or, without a checkpointer, the commit right away.
9. ``hooks`` (TrainerHooks) let a service wire metrics, logs and Redis into the loop:
   ``on_step``, ``on_publish``, ``on_checkpoint``, awaited on every rank.

Throughput. ``samples_per_s`` in the step stats is the one definition used everywhere (the
console line, ``ludic_learner_samples_per_second``, the live view, ``summary.json`` and every
bench): trained items divided by the RL wall, which is the time spent inside ``train_step``
(waiting for items, training, publishing, committing) minus the Trainer's own evaluations,
summed since this Trainer was built (``rl_wall_s``, ``items_trained_total``), or since the
run began when it resumed from a checkpoint (the totals are saved in every checkpoint).

``train(num_steps, should_stop)`` repeats ``train_step`` until ``num_steps`` more steps, until
``should_stop()`` is true on any rank, or until the source raises ``SourceStopped``
(``stop_reason`` says which: "done" or "stopped").

Batch-level credit. Before step 3, ``algo.apply_batch_stage`` finishes the credit of items
whose algorithm has a batch-level statistic (ScaleRL's std) that the credit worker left
pending: it is computed over exactly the items of this step (all ranks' shards).

Step stats of the batch. ``reward_mean`` (this rank's items' ``meta["reward"]``) and
``adv_mean`` / ``adv_std`` (``ranks.weight_stats``: mean and population std of the items'
credit ``weight``, over every rank's items) are computed once per step, after the batch
stage. The loss stats (``loss/<key>``) are per micro-batch and combined by
``loss.is_max_stat``'s rule: token-weighted means, maxima for ``_max`` keys.

Reference policy. When the loss needs ``ref_logprobs`` (a KL term, ``kl_coeff > 0``) and an
item does not carry them, a frozen reference model computes them per micro-batch (no
grad). By default it is a copy of the model as passed in (the initial policy, before LoRA
and before any checkpoint is loaded): one more forward per micro-batch and one more copy
of the weights in memory, a whole one in one process and a shard per rank under FSDP2
(sharded like the policy; its forward, a collective there, runs on every rank for every
micro-batch). With LoRA (``lora_rank``) and no reference given, there is no copy: the
reference is the policy's own forward with its adapters off (``ref_is_base``), the frozen
base. ``ref_time_s`` in the step stats is the time spent in it.

Model placement under FSDP2. Policy and reference are built by
``parallel.shard_from_rank0``: each rank's shards are filled from rank 0's weights, so only
rank 0's ``model`` (and ``reference_model``) need hold weights; the other ranks may pass
the same architecture on the meta device, and no rank ever holds the whole model on its
device. ``self.model`` is then a new, sharded module; the one passed in is not trained.

Proximal policy. When the loss needs ``prox_logprobs`` (``algo.needs_prox_logprobs``: AReaL's
``recompute_logprob`` / ``use_decoupled_loss``; or a TIS/MIS correction, whose pi_old is the
trainer's logprob, with ``ppo_n_minibatches`` > 1: ``algo.prox_logprobs_needed``), every
micro-batch first gets a no-grad forward of the current weights (eval mode, before the
update: the logprobs of the policy this step starts from) under ``batch["prox_logprobs"]``;
``prox_time_s`` in the step stats is its time. Off by default: no extra forward.

Minibatches. ``cfg.ppo_n_minibatches`` > 1 splits a step's items into that many optimizer
steps (``_update``); the proximal logprobs of all of them are taken before the first.

Temperature. Each item's logits are divided by its sampling temperature before the loss
(``loss.apply_temperature``; the reference model's too): the policy trained is the one the
actor sampled from, whose logprobs the server returned, so an on-policy ratio is exactly 1.

Autocast: ``mixed_precision_dtype`` on CUDA; on CPU only with ``cfg.cpu_autocast``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from libludic import staleness
from libludic.distributed.interfaces import PolicyPublisher
from libludic.saw import SAWItem
from libludic.training import loss as L
from libludic.training import parallel, policies, ranks
from libludic.training.algorithm import RLAlgorithm
from libludic.training.checkpoint import (
    CheckpointManager,
    LoadedCheckpoint,
    full_training_state,
    restore_training_state,
    share_checkpoint,
)
from libludic.training.collate import (
    collate,
    pack_micro_batches,
    untrainable,
)
from libludic.training.config import TrainerConfig
from libludic.training.hooks import TrainerHooks
from libludic.training.minibatch import combine_minibatch_stats, split_largest, split_minibatches
from libludic.training.publishing import VersionedPublisher
from libludic.training.spare_core import spare_core_grads, spare_core_helper
from libludic.training.types import (
    BatchSource,
    CheckpointedBatchSource,
    CommittingBatchSource,
    SourceStopped,
    check_contract,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Prepared:
    """The collated micro-batches of one optimizer step's items and their loss normalisers."""

    batches: list[dict[str, Any]]
    n_tok: list[float]  # action tokens per micro-batch (this rank's)
    macro: dict[str, float]  # over every rank: NUM_ACTION_TOKENS, NUM_SEQUENCES, WEIGHT_MEAN


class Trainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        algo: RLAlgorithm,
        batch_source: BatchSource,
        publisher: PolicyPublisher | None = None,
        cfg: TrainerConfig | None = None,
        evaluator: Any = None,
        checkpointer: CheckpointManager | None = None,
        reference_model: nn.Module | None = None,
        hooks: TrainerHooks | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else TrainerConfig()
        self.hooks = hooks if hooks is not None else TrainerHooks()
        self.algo = algo
        self.needs_prox = algo.prox_logprobs_needed(self.cfg.ppo_n_minibatches)
        self.batch_source = batch_source
        # items to acknowledge once trained (Redis entries): the source says what it trained
        self._committing = batch_source if isinstance(batch_source, CommittingBatchSource) else None
        check_contract(batch_source)
        self.evaluator = evaluator
        if evaluator is not None and getattr(evaluator, "concurrency", 0) is None:
            evaluator.concurrency = self.cfg.eval_concurrency
        self.checkpointer = checkpointer
        self.device = parallel.resolve_device(self.cfg.model_device)
        self.distributed = parallel.is_distributed()
        dt = self.cfg.autocast_dtype
        if dt is torch.float16:
            raise ValueError(
                "TrainerConfig.mixed_precision_dtype='fp16' needs loss scaling, which this "
                "trainer does not do; use 'bf16' or None"
            )
        want_amp = dt is not None and (self.device.type == "cuda" or self.cfg.cpu_autocast)
        if want_amp and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            log.warning("bf16 is not supported on %s; training in fp32", self.device)
            want_amp = False
        get_emb = getattr(model, "get_input_embeddings", None)
        emb = get_emb() if callable(get_emb) else None
        self.vocab_size: int | None = getattr(emb, "num_embeddings", None)
        self.ref_model: nn.Module | None = None
        # LoRA with no reference given: the frozen base under the adapters is the initial
        # policy, so the reference is the model with its adapters off, not a copy
        self.ref_is_base = (
            algo.needs_ref_logprobs and reference_model is None and self.cfg.lora_rank is not None
        )
        want_ref = algo.needs_ref_logprobs and not self.ref_is_base
        amp = dt if want_amp else None
        if self.distributed:
            # every rank's shards filled from rank 0's weights (parallel.shard_from_rank0):
            # the reference first, from the model as passed in (before LoRA), then the policy
            if want_ref:
                ref = reference_model if reference_model is not None else model
                self.ref_model = parallel.shard_from_rank0(ref, self.device, amp)
                self.ref_model.requires_grad_(False).eval()
            model = parallel.apply_lora(model, self.cfg)  # rank 0's adapters, on every rank
            if self.cfg.gradient_checkpointing:
                policies.enable_gradient_checkpointing(model)
            model = parallel.shard_from_rank0(model, self.device, amp)
            self._amp_dtype = None  # FSDP2's MixedPrecisionPolicy casts instead
        else:
            if want_ref:
                ref = reference_model if reference_model is not None else copy.deepcopy(model)
                ref.requires_grad_(False)
                self.ref_model = ref.to(self.device).eval()
            model = parallel.apply_lora(model, self.cfg)
            if self.cfg.gradient_checkpointing:
                policies.enable_gradient_checkpointing(model)
            model.to(self.device)
            self._amp_dtype = amp
        self.model = model
        self.spare = spare_core_helper(
            self.cfg.spare_cores,
            distributed=self.distributed,
            device=self.device,
            gradient_checkpointing=self.cfg.gradient_checkpointing,
        )
        if self.spare is not None:
            weakref.finalize(self, self.spare.close)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        # the fused kernel (one pass over all parameters; 8.2 -> 1.1 ms per step for the
        # 2.4M-parameter demo model on a CPU core) for plain tensors; FSDP2's sharded
        # DTensors keep the default multi-tensor path
        fused = not self.distributed and all(type(p) is nn.Parameter for p in self.params)
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.cfg.lr,
            betas=self.cfg.betas,
            eps=self.cfg.eps,
            weight_decay=self.cfg.weight_decay,
            fused=fused or None,
        )
        self.step = 0
        # the versions (acknowledged, rank 0's served, the counter) and the failure policy
        self.publishing = VersionedPublisher(
            publisher,
            max_failures=self.cfg.max_publish_failures,
            device=self.device,
            hooks=self.hooks,
        )
        self.stale_dropped_total = 0
        self.nonfinite_skipped_total = 0  # steps whose loss or gradient was not finite
        self.last_progress = time.monotonic()  # when a step last started or finished
        self.rl_wall_s = 0.0  # see train_step: the denominator of samples_per_s
        self.items_trained_total = 0
        self.tokens_trained_total = 0
        self.time_totals: dict[
            str, float
        ] = {}  # batch_wait_s, train_s, publish_wait_s, step_wall_s
        self.last_checkpoint_step = -1
        self.checkpoint_extra: dict[str, Any] = {}  # stored with every checkpoint
        self.stop_reason = ""

    # ------------------------------------------------------------------ helpers

    @property
    def policy_version(self) -> int:
        """The last version a publish acknowledged (``self.publishing`` owns it)."""
        return self.publishing.version

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self._amp_dtype)

    def drop_stale(self, items: Sequence[SAWItem]) -> tuple[list[SAWItem], int]:
        """Items fresh at ``policy_version`` under ``max_lag`` (libludic.staleness), and how
        many were dropped (a source that filters as it reads leaves none)."""
        kept, stale = staleness.split_stale(
            items, lambda it: it.policy_version, self.policy_version, self.cfg.max_lag
        )
        return kept, len(stale)

    def full_state_dict(
        self, to_cpu: bool = True, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """Full parameters under HF names (gathers FSDP2 shards; every rank must call;
        ``rank0_only``: the other ranks get {} and never hold the whole model)."""
        return parallel.full_state_dict(self.model, to_cpu=to_cpu, rank0_only=rank0_only)

    def publish_state_dict(
        self, to_cpu: bool = True, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """What a publish carries: the full (LoRA: merged) weights, or with
        ``cfg.lora_publish == "adapter"`` the LoRA tensors alone (peft names). Collective."""
        if self.cfg.lora_publish == "adapter":
            return parallel.adapter_state_dict(self.model, to_cpu=to_cpu, rank0_only=rank0_only)
        return self.full_state_dict(to_cpu=to_cpu, rank0_only=rank0_only)

    # ------------------------------------------------------------------ gradients

    def item_problem(self, item: SAWItem) -> str | None:
        """Why ``item`` cannot be trained by this Trainer (None: it can): the checks a
        batch source runs before an item reaches a step, so one bad item is dead-lettered
        instead of failing every step it is in (and every restart that replays it)."""
        why = untrainable(item, max_seq_len=self.cfg.max_seq_len, vocab_size=self.vocab_size)
        if why is None and self.algo.needs_actor_logprobs:
            if item.attachments.actor_logprobs is None:
                why = f"algorithm {self.algo.name!r} needs actor logprobs; the item has none"
        return why if why is not None else self.algo.item_problem(item)

    def accumulate_gradients(self, items: Sequence[SAWItem]) -> dict[str, float]:
        """Zero the grads, then forward/backward every micro-batch of ``items``.

        Afterwards ``p.grad`` holds the gradient of the full-batch loss. Returns the
        summed loss, token counts and the loss stats combined over micro-batches: the
        token-weighted mean, or the max for a ``_max`` key (``loss.is_max_stat``).
        """
        prepared = self._prepare(items)
        prox_time = self._add_proximal(prepared)
        out = self._forward_backward(prepared)
        if self.needs_prox:
            out["prox_time_s"] = prox_time
        return out

    def _prepare(self, items: Sequence[SAWItem]) -> _Prepared:
        """Micro-batches of ``items``, collated, with the loss normalisers of the whole of
        ``items`` (over every rank's shard)."""
        cfg = self.cfg
        if self.algo.needs_actor_logprobs:
            missing = [it.item_id for it in items if it.attachments.actor_logprobs is None]
            if missing:
                raise ValueError(
                    f"algorithm {self.algo.name!r} needs actor logprobs but items "
                    f"{missing[:5]} have none; sample with ReturnSpec.for_rl()"
                )
        micros = pack_micro_batches(items, cfg.micro_token_budget, cfg.max_seq_len)
        if self.spare is not None:
            # enough micro-batches for the helper to take a share
            micros = split_largest(micros, cfg.spare_core_micro_batches, cfg.max_seq_len)
        if self.distributed:
            micros = ranks.as_many_as_every_rank(micros, self.device, cfg.max_seq_len)
        batches = [collate(mb, cfg.pad_token_id, cfg.max_seq_len) for mb in micros]
        n_tok = [float(L.token_mask(b, torch.float32).sum()) for b in batches]
        n_seq = [float((L.token_mask(b, torch.float32).sum(-1) > 0).sum()) for b in batches]
        totals = torch.tensor(
            [sum(n_tok), sum(n_seq), sum(float(it.weight) for it in items), float(len(items))],
            dtype=torch.float64,
        )
        if self.distributed:
            # all_reduce on the model's device (gloo: CPU, NCCL: GPU)
            t = totals.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            totals = t.cpu()
        tot_tok, tot_seq, w_sum, n_items = (float(x) for x in totals)
        macro = {
            L.NUM_ACTION_TOKENS_KEY: max(tot_tok, 1.0),
            L.NUM_SEQUENCES_KEY: max(tot_seq, 1.0),
            L.WEIGHT_MEAN_KEY: w_sum / max(n_items, 1.0),
        }
        return _Prepared(batches, n_tok, macro)

    def _add_proximal(self, prepared: _Prepared) -> float:
        """Put the current weights' logprobs in every micro-batch of ``prepared`` (if the
        loss needs them and they are not there yet); returns the seconds it took."""
        if not self.needs_prox:
            return 0.0
        t = time.perf_counter()
        for b in prepared.batches:
            if L.PROX_LOGPROBS_KEY not in b:
                dev_b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
                b[L.PROX_LOGPROBS_KEY] = self.proximal_logprobs(dev_b)
        return time.perf_counter() - t

    def _micro_loss(
        self, prepared: _Prepared, i: int
    ) -> tuple[torch.Tensor, dict[str, Any], float]:
        """Micro-batch ``i``'s loss (scaled for FSDP2's averaging), its stats and the seconds
        its reference forward took."""
        cfg = self.cfg
        dev_b: dict[str, Any] = {
            k: v.to(self.device, non_blocking=True) for k, v in prepared.batches[i].items()
        }
        dev_b.update(prepared.macro)
        ref_time = 0.0
        # sharded, the reference's forward is a collective: every rank runs it for every
        # micro-batch, and keeps it only where the items brought none
        has_ref = self.ref_model is not None or self.ref_is_base
        if has_ref and ("ref_logprobs" not in dev_b or self.distributed):
            t_ref = time.perf_counter()
            ref_lp = self.reference_logprobs(dev_b)
            dev_b.setdefault("ref_logprobs", ref_lp)
            ref_time = time.perf_counter() - t_ref
        with self._autocast():
            out = self.model(input_ids=dev_b["input_ids"], attention_mask=dev_b["attention_mask"])
        logits = out.logits if hasattr(out, "logits") else out
        if cfg.cast_logits_to_fp32:
            logits = logits.float()
        logits = L.apply_temperature(logits, dev_b)
        loss, stats = self.algo.loss.compute(logits, dev_b)
        return loss, stats, ref_time

    def _forward_backward(self, prepared: _Prepared) -> dict[str, float]:
        batches, n_tok = prepared.batches, prepared.n_tok
        scale = float(dist.get_world_size()) if self.distributed else 1.0
        self.optimizer.zero_grad(set_to_none=True)
        MicroOut = tuple[float, dict[str, Any], float]

        def summary(loss: torch.Tensor, stats: dict[str, Any], ref_time: float) -> MicroOut:
            return float(loss.detach()), {k: float(v) for k, v in stats.items()}, ref_time

        def main_fn(i: int) -> MicroOut:
            if hasattr(self.model, "set_requires_gradient_sync"):
                # FSDP2: reduce-scatter only after the last micro-batch
                self.model.set_requires_gradient_sync(i == len(batches) - 1)  # type: ignore[operator]
            loss, stats, ref_time = self._micro_loss(prepared, i)
            (loss * scale).backward()  # type: ignore[no-untyped-call]
            return summary(loss, stats, ref_time)

        results: list[MicroOut]
        if self.spare is not None and len(batches) > 1:

            def helper_fn(i: int) -> tuple[MicroOut, list[torch.Tensor | None]]:
                loss, stats, ref_time = self._micro_loss(prepared, i)
                grads = spare_core_grads(loss * scale, self.params)
                return summary(loss, stats, ref_time), grads

            before = self.spare.micro_batches_total
            results, helper_grads = self.spare.run(len(batches), main_fn, helper_fn)
            spare_share = (self.spare.micro_batches_total - before) / len(batches)
            for p, g in zip(self.params, helper_grads or []):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        else:
            results = [main_fn(i) for i in range(len(batches))]
            spare_share = None
        loss_sum = 0.0
        ref_time = 0.0
        stat_acc: dict[str, float] = {}
        local_tok = max(sum(n_tok), 1.0)
        for i, (loss_v, stats, ref_t) in enumerate(results):
            loss_sum += loss_v
            ref_time += ref_t
            share = n_tok[i] / local_tok
            for k, v in stats.items():
                if k == "loss":
                    continue
                if L.is_max_stat(k):  # a maximum: the batch's is the largest micro-batch's
                    stat_acc[k] = max(stat_acc.get(k, v), v)
                else:
                    stat_acc[k] = stat_acc.get(k, 0.0) + share * v
        out_stats = {f"loss/{k}": v for k, v in stat_acc.items()}
        out_stats.update(
            loss=loss_sum,
            num_micro_batches=float(len(batches)),
            num_action_tokens=sum(n_tok),
            num_padded_tokens=float(sum(b["input_ids"].numel() for b in batches)),
        )
        if self.ref_model is not None or self.ref_is_base:
            out_stats["ref_time_s"] = ref_time
        if spare_share is not None:  # the micro-batches the spare-core thread trained
            out_stats["spare_core_share"] = spare_share
        return out_stats

    def _logprobs(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return policies.every_token_logprobs(model, batch, self._autocast())

    def reference_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The frozen reference policy's logprobs (``_logprobs``): what ``TokenKLLoss`` reads."""
        if self.ref_is_base:  # peft: the base weights alone (adapters off, no dropout)
            with policies.evaluating(self.model), self.model.disable_adapter():  # type: ignore[operator]
                return self._logprobs(self.model, batch)
        assert self.ref_model is not None
        return self._logprobs(self.ref_model, batch)

    def proximal_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """The current weights' logprobs (``_logprobs``, eval mode, no grad): pi_prox of the
        decoupled loss, pi_old under ``recompute_logprob``."""
        with policies.evaluating(self.model):
            return self._logprobs(self.model, batch)

    def _update(self, items: Sequence[SAWItem]) -> dict[str, float]:
        """Forward, backward and the optimizer step(s) of ``items``.

        ``cfg.ppo_n_minibatches`` = n > 1: the items are split into n minibatches
        (``split_minibatches``; fewer when a rank holds fewer than n items, the same number
        on every rank), each with its own loss normalisers and its own optimizer step, all
        at this trainer step's learning rate. The proximal logprobs a decoupled loss (or a
        TIS/MIS correction) needs are taken for every minibatch before the first update: they are the policy this
        step starts from, not the one the previous minibatch left. Stats: ``loss`` and
        ``grad_norm`` are means over the minibatches, the loss stats token-weighted means
        (maxima for a ``_max`` key), counts and times sums; ``num_minibatches`` says how
        many ran. Runs in ``off_loop``'s thread, which sets the device."""
        self.model.train()
        n = min(self.cfg.ppo_n_minibatches, len(items))
        if self.distributed and self.cfg.ppo_n_minibatches > 1:
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
        if n <= 1:
            out = self.accumulate_gradients(items)
            out["grad_norm"] = self.optimizer_step()
            out["num_minibatches"] = 1.0
            return out
        prepared = [self._prepare(part) for part in split_minibatches(items, n)]
        prox_time = sum(self._add_proximal(p) for p in prepared)
        parts: list[dict[str, float]] = []
        for p in prepared:
            st = self._forward_backward(p)
            st["grad_norm"] = self.optimizer_step()
            parts.append(st)
        out = combine_minibatch_stats(parts)
        if self.needs_prox:
            out["prox_time_s"] = prox_time
        return out

    def optimizer_step(self) -> float:
        """Clip (if configured), step AdamW at this step's scheduled learning rate
        (``TrainerConfig.lr_at``); returns the pre-clip global grad norm.

        A non-finite norm (a NaN or inf loss or gradient anywhere, on any rank: the norm is
        global) skips the update: the gradients are dropped, the weights and the optimizer
        state stay as they were, ``nonfinite_skipped_total`` counts it."""
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        full = getattr(norm, "full_tensor", None)
        norm = full() if callable(full) else norm
        value = float(norm)
        if math.isfinite(value):
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr_at(self.step)
            self.optimizer.step()
        else:
            self.nonfinite_skipped_total += 1
            log.warning(
                "step %d: gradient norm is %s; update skipped (%d so far), weights unchanged",
                self.step + 1,
                value,
                self.nonfinite_skipped_total,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return value

    # ------------------------------------------------------------------ loop

    async def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.last_progress = time.monotonic()
        batch = await self.batch_source.next_batch()
        t_batch = time.perf_counter()
        items, dropped = self.drop_stale(batch.items)
        self.stale_dropped_total += dropped
        # a source that drops stale items before batching (PipelineBatchSource) counts them
        committing = self._committing
        source_stale = int(committing.stale_dropped) if committing is not None else 0
        sums = functools.partial(ranks.all_sum, device=self.device) if self.distributed else None
        items = self.algo.apply_batch_stage(items, sums)
        stats: dict[str, float] = {
            "num_items": float(len(items)),
            "num_tokens": float(sum(it.num_tokens for it in items)),
            "stale_dropped": float(dropped),
            "stale_dropped_total": float(self.stale_dropped_total + source_stale),
            "nonfinite_skipped_total": float(self.nonfinite_skipped_total),
            "lr": self.cfg.lr_at(self.step),  # this step's
        }
        rewards = [float(it.meta["reward"]) for it in items if "reward" in it.meta]
        stats["reward_mean"] = sum(rewards) / len(rewards) if rewards else 0.0
        stats.update(ranks.weight_stats(items, self.device if self.distributed else None))
        if not items and self.distributed:
            raise RuntimeError(
                f"rank {parallel.rank()} has no items at step {self.step + 1} (dropped "
                f"{dropped} stale); under FSDP2 every rank must train on a non-empty shard: "
                "raise max_lag or give every rank its own batch"
            )
        if items:
            stats.update(await self.off_loop(self._update, items))
            stats["nonfinite_skipped_total"] = float(self.nonfinite_skipped_total)
        else:
            log.warning(
                "step %d: no items left after dropping %d stale; no update", self.step + 1, dropped
            )
            stats.update(loss=0.0, grad_norm=0.0)
        t_train = time.perf_counter()
        self.step += 1
        ids: list[str] = list(committing.mark_trained()) if committing is not None else []
        if self.hooks.on_trained is not None:
            await self.hooks.on_trained(self.step, ids)
        dt = max(time.perf_counter() - t0, 1e-9)
        if self.distributed:  # each rank's loss is its share of the batch loss: sum them
            t = torch.tensor(
                [stats["loss"], stats["num_tokens"]], dtype=torch.float64, device=self.device
            )
            dist.all_reduce(t)
            stats["loss"], stats["num_tokens"] = float(t[0]), float(t[1])
        batch_items = float(len(ids)) if ids else stats["num_items"]
        stats.update(step=float(self.step), batch_items=batch_items, step_time_s=dt)
        # (step_time_s: batch wait + update; step_wall_s, set below: the whole step)
        t_pub = time.perf_counter()
        if self.publishing.publisher is not None and self.step % self.cfg.sync_every_steps == 0:
            if self.cfg.async_publish:
                await self.start_publish()
            else:
                await self.publish()
        stats["publish_wait_s"] = time.perf_counter() - t_pub
        stats["batch_wait_s"] = t_batch - t0  # waiting for the batch source (items)
        stats["train_s"] = t_train - t_batch  # forward, backward, optimizer step
        stats["policy_version"] = float(self.policy_version)
        n_eval = self.cfg.eval_every_n_steps
        eval_s = 0.0
        if self.evaluator is not None and n_eval and self.step % n_eval == 0:
            t_eval = time.perf_counter()
            stats.update(await self.evaluate())
            eval_s = time.perf_counter() - t_eval
        # the one definition of throughput: trained items per second of RL wall (every
        # train_step from its start to its end, evaluation excluded); the totals count the
        # step before its checkpoint, which saves them
        self.items_trained_total += int(batch_items)
        self.tokens_trained_total += int(stats["num_tokens"])
        before_commit = time.perf_counter() - t0 - eval_s
        self.rl_wall_s += before_commit
        if self.checkpointer is None:
            await self.commit()
        elif self.checkpointer.should_save(self.step):
            await self.checkpoint()
        wall = time.perf_counter() - t0 - eval_s
        self.rl_wall_s += wall - before_commit
        for k, v in (
            ("batch_wait_s", stats["batch_wait_s"]),
            ("train_s", stats["train_s"]),
            ("publish_wait_s", stats["publish_wait_s"]),
            ("step_wall_s", wall),
        ):
            self.time_totals[k] = self.time_totals.get(k, 0.0) + v
        stats.update(
            step_wall_s=wall,
            rl_wall_s=self.rl_wall_s,
            samples_per_s=self.items_trained_total / max(self.rl_wall_s, 1e-9),
            tokens_per_s=self.tokens_trained_total / max(self.rl_wall_s, 1e-9),
            eval_s=eval_s,
        )
        if (
            self.hooks.on_log is not None
            and self.step % self.cfg.log_every == 0
            and parallel.rank() == 0
        ):
            self.hooks.on_log(stats, self.policy_version)
        self.last_progress = time.monotonic()
        if self.hooks.on_step is not None:
            await self.hooks.on_step(stats, ids)
        return stats

    async def train(
        self, num_steps: int | None = None, should_stop: Callable[[], bool] | None = None
    ) -> list[dict[str, float]]:
        """Run ``num_steps`` more optimizer steps (None: until stopped); returns per-step
        stats. Ends early, with ``stop_reason = "stopped"``, once ``should_stop()`` is true on
        any rank (checked before each step) or the source raises SourceStopped."""
        if num_steps is not None and num_steps < 0:
            raise ValueError(f"num_steps={num_steps} must be >= 0")
        if self.cfg.eval_at_start and self.evaluator is not None:
            log.info("eval at start: %s", await self.evaluate())
        history: list[dict[str, float]] = []
        self.stop_reason = "done"
        while num_steps is None or len(history) < num_steps:
            stop = should_stop is not None and should_stop()
            if self.distributed:
                stop = ranks.any_rank(stop, self.device)
            if stop:
                self.stop_reason = "stopped"
                break
            try:
                history.append(await self.train_step())
            except SourceStopped:
                self.stop_reason = "stopped"
                break
        return history

    async def publish(self) -> bool:
        """Publish the current weights and wait for the outcome; True once served. Every
        rank calls it (the gather is collective under FSDP2)."""
        await self.start_publish()
        return bool(await self.finish_publish())

    def snapshot_state_dict(self) -> dict[str, torch.Tensor]:
        """The published state dict (:meth:`publish_state_dict`) as CPU tensors that later
        training steps cannot change, on rank 0 ({} elsewhere: every rank must call it, the
        gather is collective under FSDP2, but only rank 0 sends and only it holds the whole
        model). Gathered and device-to-host tensors are fresh already; a CPU model's own
        tensors are copied."""
        live = set()
        for t in [*self.model.parameters(), *self.model.buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            live.add(local.untyped_storage().data_ptr())
        return {
            k: v.clone() if v.untyped_storage().data_ptr() in live else v
            for k, v in self.publish_state_dict(rank0_only=True).items()
        }

    async def start_publish(self) -> None:
        """Finish the publish in flight, snapshot the weights and start sending them as the
        next version (every rank must call this: the gather is collective under FSDP2)."""
        await self.publishing.start(lambda: self.off_loop(self.snapshot_state_dict), self.step)

    async def finish_publish(self) -> bool | None:
        """Wait for the publish in flight and apply its outcome on every rank
        (:meth:`VersionedPublisher.finish`)."""
        return await self.publishing.finish()

    async def commit(self) -> int:
        """Commit the batch source's trained items (a CommittingBatchSource's ``commit()``)."""
        return int(await self._committing.commit()) if self._committing is not None else 0

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, on this trainer's device (the current CUDA
        device is per thread): the event loop's other tasks (the service's /health and
        /metrics, heartbeats) keep answering through long work, a step, a checkpoint or a
        gather of the full weights, however large the model. Collective work stays in
        order: each rank awaits it before its next."""

        def run() -> T:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            return fn(*args)

        return await asyncio.to_thread(run)

    def _checkpointer(self) -> CheckpointManager:
        if self.checkpointer is None:
            raise ValueError(
                "Trainer has no checkpointer; pass checkpointer=CheckpointManager(...)"
            )
        return self.checkpointer

    async def checkpoint(self) -> Path | None:
        """Save a checkpoint of this step (once; collective under FSDP2), then commit the
        items it includes. Returns its path on rank 0."""
        self._checkpointer()  # raises without one
        if self.step == self.last_checkpoint_step:
            return None
        path = await self.off_loop(self.save_checkpoint, self.checkpoint_extra)
        self.last_checkpoint_step = self.step
        n = await self.commit()
        if self.hooks.on_checkpoint is not None:
            await self.hooks.on_checkpoint(path, n)
        return path

    async def evaluate(self) -> dict[str, float]:
        self.model.eval()
        try:
            res = await self.evaluator.evaluate()
        finally:
            self.model.train()
        return {k if k.startswith("eval/") else f"eval/{k}": float(v) for k, v in res.items()}

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, extra: dict[str, Any] | None = None) -> Path | None:
        """Model + optimizer + RNG + step + policy_version + the throughput totals
        (``rl_wall_s``, items and tokens trained: a resumed Trainer's ``samples_per_s``
        covers the steps before the resume) (+ batch-source position)."""
        checkpointer = self._checkpointer()
        msd, osd = full_training_state(self.model, self.optimizer)  # collective under FSDP2
        if parallel.rank() != 0:
            return None
        ex: dict[str, Any] = {
            "trainer_step": self.step,
            "policy_version": self.policy_version,
            # the throughput totals continue across a resume (samples_per_s covers the run)
            "rl_wall_s": self.rl_wall_s,
            "items_trained_total": self.items_trained_total,
            "tokens_trained_total": self.tokens_trained_total,
        }
        if isinstance(self.batch_source, CheckpointedBatchSource):
            ex["batch_source"] = self.batch_source.state_dict()
        ex.update(extra or {})
        return checkpointer.save(self.step, msd, osd, extra=ex)

    def load_checkpoint(self, path: Path | None = None) -> LoadedCheckpoint | None:
        """Restore the newest valid checkpoint (or ``path``); None if there is none.
        Under FSDP2 rank 0 reads it and every rank gets it from rank 0 (``share_checkpoint``,
        then the tensors broadcast into the shards): only rank 0 needs the files, and no
        other rank holds the whole model or optimizer state."""
        checkpointer = self._checkpointer()
        if self.distributed:
            ck = checkpointer.load(path) if parallel.rank() == 0 else None
            ck = share_checkpoint(ck, self.device)
        else:
            ck = checkpointer.load(path)
        if ck is None:
            return None
        restore_training_state(self.model, self.optimizer, ck, from_rank0=self.distributed)
        self.step = int(ck.extra.get("trainer_step", ck.step))
        self.last_checkpoint_step = self.step
        self.publishing.restore(int(ck.extra.get("policy_version", 0)))
        self.rl_wall_s = float(ck.extra.get("rl_wall_s", 0.0))
        self.items_trained_total = int(ck.extra.get("items_trained_total", 0))
        self.tokens_trained_total = int(ck.extra.get("tokens_trained_total", 0))
        if "batch_source" in ck.extra and isinstance(self.batch_source, CheckpointedBatchSource):
            self.batch_source.load_state_dict(ck.extra["batch_source"])
        return ck
