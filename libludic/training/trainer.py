"""Trainer: the RL loop. One optimizer step (``train_step``):

1. ``batch_source.next_batch()`` gives the step's items (``hooks.on_idle`` while it waits);
   ``self.admission`` (libludic/training/admission.py) judges them once: a source that forms
   batches itself is handed it, any other source's stale items are dropped here.
2. ``algo.apply_batch_stage`` finishes batch-level credit (ScaleRL's std) over exactly the
   step's items (every rank's shard); with a critic (PPO) the stepper computes the
   advantages itself, by GAE over the critic's values (``critic_model``: the value model,
   default one built from the policy; libludic/training/critic.py).
3. ``self.stepper`` (libludic/training/step.py) makes the update: micro-batches, exact
   gradient accumulation, the clipped AdamW step; a non-finite norm skips it.
4. The source's items are marked trained (``mark_trained()``), ``hooks.on_trained``.
5. Every ``sync_every_steps`` steps the weights are published through ``self.publishing``
   (libludic/training/publishing.py: the one version counter, double buffering, the failure
   policy); with ``cfg.async_publish`` the next step trains while they are sent.
   ``policy_version`` is the last version acknowledged: what inference serves.
6. Every ``eval_every_n_steps`` the evaluator; then the checkpoint when
   ``checkpointer.should_save(step)``, after which the trained items are committed (an item
   is committed iff it is inside a saved checkpoint); without a checkpointer at once.

Throughput (``self.throughput``, libludic/training/throughput.py): ``samples_per_s``, the
one definition everywhere, items trained per second of RL wall. Step stats: ``reward_mean``
(this rank's items), ``adv_mean``/``adv_std`` (every rank's weights; with a critic, GAE's
per-token advantages), ``loss/<key>`` (token-weighted means, maxima for ``_max`` keys), the
times ``batch_wait_s``, ``train_s``, ``publish_wait_s``, ``step_wall_s``.

``train(num_steps, should_stop)`` repeats ``train_step`` until ``num_steps`` more steps,
``should_stop()`` on any rank, or ``SourceStopped`` (``stop_reason``: "done" or "stopped").
``hooks`` (TrainerHooks) wire a service's metrics, logs and Redis into the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from libludic.distributed.interfaces import PolicyPublisher
from libludic.saw import SAWItem
from libludic.training import parallel, ranks
from libludic.training.admission import Admission, AdmittingBatchSource
from libludic.training.algorithm import RLAlgorithm
from libludic.training.checkpoint import (
    CheckpointManager,
    LoadedCheckpoint,
    load_trainer,
    save_trainer,
)
from libludic.training.config import TrainerConfig
from libludic.training.hooks import TrainerHooks
from libludic.training.publishing import VersionedPublisher
from libludic.training.step import OptimizerStep
from libludic.training.throughput import Throughput
from libludic.training.types import (
    BatchSource,
    CommittingBatchSource,
    SourceIdle,
    SourceStopped,
    check_contract,
)

log = logging.getLogger(__name__)


@runtime_checkable
class UnsetConcurrency(Protocol):
    """An evaluator with a ``concurrency`` the Trainer fills in (``eval_concurrency``) when
    it is None (libludic.eval.Evaluator)."""

    concurrency: int | None


T = TypeVar("T")


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
        critic_model: nn.Module | None = None,
    ) -> None:
        self.cfg = cfg if cfg is not None else TrainerConfig()
        self.hooks = hooks if hooks is not None else TrainerHooks()
        self.algo = algo
        self.batch_source = batch_source
        # items to acknowledge once trained (Redis entries): the source says what it trained
        self._committing = batch_source if isinstance(batch_source, CommittingBatchSource) else None
        check_contract(batch_source)
        self.evaluator = evaluator
        if isinstance(evaluator, UnsetConcurrency) and evaluator.concurrency is None:
            evaluator.concurrency = self.cfg.eval_concurrency
        self.checkpointer = checkpointer
        # the policy, its reference, its critic (PPO), the optimizer: one step's update
        self.stepper = OptimizerStep(
            model=model,
            algo=algo,
            cfg=self.cfg,
            reference_model=reference_model,
            critic_model=critic_model,
        )
        st = self.stepper
        self.model, self.ref_model, self.ref_is_base = st.model, st.ref_model, st.ref_is_base
        self.critic = st.critic
        self.optimizer, self.spare = st.optimizer, st.spare
        self.device, self.distributed = st.device, st.distributed
        self.step = 0
        # the versions (acknowledged, rank 0's served, the counter) and the failure policy
        self.publishing = VersionedPublisher(
            publisher,
            max_failures=self.cfg.max_publish_failures,
            device=self.device,
            hooks=self.hooks,
        )
        # which items a step may train (staleness, trainability), judged once: by a source
        # that forms batches itself, else by drop_stale at the start of the step
        self.admission = Admission(self.cfg.max_lag, self.publishing, self.stepper)
        self._source_admits = isinstance(batch_source, AdmittingBatchSource)
        if isinstance(batch_source, AdmittingBatchSource):
            batch_source.admission = self.admission
        self.stale_dropped_total = 0
        self.last_progress = time.monotonic()  # when a step last started or finished
        self.throughput = Throughput()  # samples_per_s: libludic/training/throughput.py
        self.last_checkpoint_step = -1
        self.checkpoint_extra: dict[str, Any] = {}  # stored with every checkpoint
        self.stop_reason = ""

    # ------------------------------------------------------------------ helpers

    @property
    def policy_version(self) -> int:
        """The last version a publish acknowledged (``self.publishing`` owns it)."""
        return self.publishing.version

    def drop_stale(self, items: Sequence[SAWItem]) -> tuple[list[SAWItem], int]:
        """Items fresh at ``policy_version`` under ``max_lag`` (``self.admission``), and how
        many were dropped."""
        kept, stale = self.admission.split_stale(items, lambda it: it, served=False)
        return kept, len(stale)

    @property
    def nonfinite_skipped_total(self) -> int:
        """Steps whose loss or gradient was not finite (skipped, weights unchanged)."""
        return self.stepper.nonfinite_skipped_total

    def full_state_dict(
        self, to_cpu: bool = True, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """Full parameters under HF names (collective under FSDP2; see OptimizerStep)."""
        return self.stepper.full_state_dict(to_cpu=to_cpu, rank0_only=rank0_only)

    def accumulate_gradients(self, items: Sequence[SAWItem]) -> dict[str, float]:
        """Zero the grads, then forward/backward every micro-batch of ``items``."""
        return self.stepper.accumulate_gradients(items)

    # ------------------------------------------------------------------ loop

    async def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.last_progress = time.monotonic()
        while True:
            try:
                batch = await self.batch_source.next_batch()
                break
            except SourceIdle:
                if self.hooks.on_idle is not None:
                    await self.hooks.on_idle()
        t_batch = time.perf_counter()
        items, dropped = (batch.items, 0) if self._source_admits else self.drop_stale(batch.items)
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
            stats.update(await self.off_loop(self.stepper.update, items, self.step))
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
        # RL wall: every train_step from its start to its end, evaluation excluded; the
        # totals count the step before its checkpoint, which saves them
        tp = self.throughput
        tp.count(int(batch_items), int(stats["num_tokens"]))
        before_commit = time.perf_counter() - t0 - eval_s
        tp.rl_wall_s += before_commit
        if self.checkpointer is None:
            await self.commit()
        elif self.checkpointer.should_save(self.step):
            await self.checkpoint()
        wall = time.perf_counter() - t0 - eval_s
        tp.rl_wall_s += wall - before_commit
        stats.update(step_wall_s=wall, rl_wall_s=tp.rl_wall_s, eval_s=eval_s)
        stats.update(samples_per_s=tp.samples_per_s, tokens_per_s=tp.tokens_per_s)
        tp.add_times(stats)
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

    async def start_publish(self) -> None:
        """Finish the publish in flight, snapshot the weights and start sending them as the
        next version (every rank must call this: the gather is collective under FSDP2)."""
        await self.publishing.start(
            lambda: self.off_loop(self.stepper.snapshot_state_dict), self.step
        )

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
        """Model, optimizer, RNG, step, version, throughput totals and the batch source's
        position (checkpoint.py ``save_trainer``; collective under FSDP2; rank 0's path)."""
        return save_trainer(self, self._checkpointer(), extra)

    def load_checkpoint(self, path: Path | None = None) -> LoadedCheckpoint | None:
        """Restore the newest valid checkpoint (or ``path``); None if there is none
        (checkpoint.py ``load_trainer``: under FSDP2 only rank 0 needs the files)."""
        return load_trainer(self, self._checkpointer(), path)
