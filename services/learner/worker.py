"""The learner's wiring of the library loop: ``Learner`` builds the batch source, the
publisher, the checkpoint manager and the hooks around ``Trainer.train`` (the guarantees:
services/learner/README.md, "Guarantees"). ``main.py`` wires it into a process.

The loop is the library's (``Trainer.train``: batch, stale filter, step, publish, checkpoint
and commit, stop conditions; ``Trainer`` is the only writer of the policy version); this
module wires settings, Redis and metrics into it: ``PipelineBatchSource`` (rank 0 reads
Redis, shares the batch; it judges items with the Trainer's Admission before batching), the publisher, the checkpoint manager and ``TrainerHooks``
(metrics, the version in Redis, the status entry, the trained-items log). The full state
dict is gathered only for a publish or a checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import random
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from libludic import transport
from libludic.distributed.interfaces import WeightPlane
from libludic.distributed.publisher import (
    BroadcastPolicyPublisher,
    HttpPolicyPublisher,
    ReplicaSet,
    RetryPolicy,
    replica_versions,
)
from libludic.distributed.weight_sync import to_safetensors_bytes
from libludic.training import parallel, ranks
from libludic.training.batching.pipeline import PipelineBatchSource
from libludic.training.checkpoint import CheckpointManager
from libludic.training.loss import declared_stat_keys
from libludic.training.model_api import is_peft
from libludic.training.publishing import PublishFailed
from libludic.training.trainer import Trainer, TrainerHooks
from libludic.transport import accounting
from services.common.settings import redacted
from services.learner import metrics as M
from services.learner.settings import LearnerSettings
from services.learner.tracker import run_config

log = logging.getLogger("ludic.learner")

TRAINED_LOG = "trained_items.jsonl"
HEARTBEAT_TTL_S = 120.0


def load_policy(s: LearnerSettings, weights: bool = True) -> Any:
    """The model to train from ``s.model_dir``, in fp32, with the attention implementation
    ``s.attn_impl`` (empty: transformers' default). ``weights`` False: the architecture
    only, on the meta device (FSDP2 ranks but 0 receive their shards by broadcast)."""
    attn = {"attn_implementation": s.attn_impl} if s.attn_impl else {}
    if weights:
        return AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32, **attn)
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(s.model_dir)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn)


class LearnerFatal(RuntimeError):
    """The learner cannot go on (e.g. too many consecutive failed publishes)."""


def init_distributed(device: str) -> None:
    """Join the torchrun process group (WORLD_SIZE > 1): NCCL on CUDA, gloo otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or parallel.is_distributed():
        return
    use_cuda = device.startswith("cuda") and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Learner:
    """One learner process (module docstring; its guarantees: services/learner/README.md,
    "Guarantees"). In detail:

    - A checkpoint's extra holds ``batch_source.last_committed_id``, ``items_trained``,
      ``policy_version`` and ``trainer_step``. ``--resume`` loads the newest complete
      checkpoint (model, optimizer, step, RNG, policy version, stream position), so every
      item trained after it is trained again exactly once, in the same batches.
    - A publish labels the weights ``max(learner version, floor) + 1``, ``floor`` the highest
      version seen at start-up in Redis or on any replica, so a restarted learner never
      publishes a version the replicas refuse as old. After a successful publish the version
      goes to Redis (``ludic:{run}:policy_version``, which actors' admission control reads).
      Without ``inference_urls`` nothing is published.
    - A failed publish is counted (``ludic_learner_publishes_total{outcome="failed"}``,
      ``ludic_learner_publish_failures_total{replica}``) and the learner's served version
      does not move; its number is never reused: a replica that took the failed one must not
      hold other weights than its peers under it (libludic/training/trainer.py).
    - At ``num_steps`` the final publish happens only if the last step did not publish. A
      clean exit with ``output_dir`` set saves the policy as a Hugging Face model directory
      ``<output_dir>/final/``.
    """

    def __init__(self, s: LearnerSettings, stop: asyncio.Event) -> None:
        self.s = s
        self.stop = stop
        self.rank = parallel.rank()
        self.keys = transport.Keys(s.run_id)
        self.r: Any = None
        self._sync_redis: Any = None  # the publish thread's client (TrainerHooks.on_served)
        self._announced = 0  # the last version the publish thread announced to Redis
        self.trainer: Trainer | None = None
        self.started_at = time.monotonic()
        self.publisher: WeightPlane | None = None  # the Trainer wraps it (Rank0OnlyPublisher)
        self.logger: M.StepLogger | None = None
        self.ckcfg = s.checkpoint_config()
        self.trained_log: Path | None = None
        self.accounting: dict[str, Any] | None = None  # last libludic.transport.accounting snapshot
        log_dir = self.ckcfg.output_dir if self.ckcfg is not None else s.output_dir
        if s.trained_log and log_dir:
            self.trained_log = Path(log_dir) / TRAINED_LOG

    # ------------------------------------------------------------------ setup

    def _build(self) -> None:
        s = self.s
        if not s.model_dir or not Path(s.model_dir).exists():
            raise ValueError(
                f"learner model_dir={s.model_dir!r} does not exist; set --model-dir / LUDIC_MODEL_DIR "
                "(e.g. `ludic model init DIR --size tiny`)"
            )
        seed_everything(s.seed)
        model = load_policy(s, weights=self.rank == 0)
        cfg = s.trainer_config()
        pad: Any = cfg.pad_token_id
        if "pad_token_id" not in s.trainer:  # the model's pad (else EOS) token
            pad = getattr(model.config, "pad_token_id", None)
            if pad is None:
                eos = getattr(model.config, "eos_token_id", 0)
                pad = eos[0] if isinstance(eos, list) else (eos or 0)
        cfg = dataclasses.replace(cfg, pad_token_id=int(pad))
        device = parallel.resolve_device(cfg.model_device)
        source = PipelineBatchSource(
            redis=self.r,
            keys=self.keys if self.rank == 0 else None,
            batch_size=s.batch_size,
            # (the Trainer hands it its Admission: staleness at rank 0's served version,
            # decided for every rank, and the stepper's item problems)
            consumer=s.consumer,
            block_ms=s.block_ms,
            max_deliveries=s.max_deliveries,
            device=device,
            stop_fn=self.stop.is_set,
            on_stale=M.STALE_DROPPED.inc,
            idle_every_s=s.replica_check_s if s.inference_urls and s.replica_check_s > 0 else None,
        )
        if s.inference_urls:
            retry = RetryPolicy(
                max_attempts=s.publish_attempts,
                attempt_timeout_s=s.publish_timeout_s,
                connect_timeout_s=min(5.0, s.publish_timeout_s),
                total_timeout_s=s.publish_total_timeout_s,
            )
            replicas = ReplicaSet(s.inference_urls)
            inner: WeightPlane
            if s.publish_plane == "http":
                inner = HttpPolicyPublisher(
                    replicas,
                    s.token(),
                    retry,
                    on_result=M.on_replica_result,
                    wire_dtype=s.publish_dtype,
                    adapter=parallel.adapter_config(cfg) if cfg.lora_publish == "adapter" else None,
                )
            else:
                if not s.collective_master_address:
                    raise ValueError(
                        "publish_plane=collective needs collective_master_address (an address of "
                        "this learner the inference replicas can reach)"
                    )
                backend = s.collective_backend or ("nccl" if device.type == "cuda" else "gloo")
                inner = BroadcastPolicyPublisher(
                    replicas,
                    s.collective_master_address,
                    s.collective_master_port,
                    s.token(),
                    backend,
                    retry,
                    on_result=M.on_replica_result,
                )
            self.publisher = inner
        self.source = source
        self.device = device
        self.trainer = Trainer(
            model=model,
            algo=s.spec.build(),
            batch_source=source,
            publisher=self.publisher,
            cfg=cfg,
            checkpointer=CheckpointManager(self.ckcfg) if self.ckcfg is not None else None,
            hooks=TrainerHooks(
                on_trained=self._on_trained,
                on_step=self._on_step,
                on_publish=self._on_publish,
                on_checkpoint=self._on_checkpoint,
                on_served=self._on_served,
                on_idle=self._on_idle,
            ),
        )
        self.trainer.checkpoint_extra = {"run_id": s.run_id}

    def _cut_trained_log(self, step: int) -> None:
        if self.rank != 0 or self.trained_log is None:
            return
        self.trained_log.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if self.trained_log.exists():
            for line in self.trained_log.read_text().splitlines():
                try:
                    if int(json.loads(line)["step"]) <= step:
                        kept.append(line)
                except (ValueError, KeyError):
                    continue
        self.trained_log.write_text("".join(k + "\n" for k in kept))

    def _shared_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank."""
        if not parallel.is_distributed():
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return [int(x) for x in t.tolist()]

    async def setup(self) -> None:
        if self.rank == 0:
            self.r = transport.connect(self.s.redis_url, socket_timeout=self.s.block_ms / 1000 + 30)
            if not self.s.resume:  # the base weights (step 0) are served: admit generation now
                await self._announce(0)
        self._build()
        tr = self.trainer
        assert tr is not None
        resumed = False
        if self.s.resume:
            ck = tr.load_checkpoint()
            if ck is None:
                log.warning(
                    "--resume: no complete checkpoint in %s; starting fresh",
                    self.ckcfg.output_dir if self.ckcfg else "?",
                )
            else:
                resumed = True
                log.info(
                    "resumed from %s: step %d, policy version %d, stream position %s",
                    ck.path,
                    tr.step,
                    tr.policy_version,
                    self.source.last_committed_id,
                )
        self._cut_trained_log(tr.step)
        if self.rank == 0:
            await self.source.start()
        # version floor: never publish a version Redis or a replica already has
        floor = 0
        if self.rank == 0:
            floor = await transport.retry_redis(
                lambda: transport.get_policy_version(self.r, self.keys),
                deadline_s=60,
                stop=self.stop,
            )
            if self.publisher is not None:
                vs = replica_versions(self.publisher.replicas.resolve(), token=self.s.token())
                floor = max([floor] + [v for v in vs.values() if v is not None])
        (floor,) = self._shared_ints([floor])
        tr.publishing.raise_floor(floor)
        M.STEP.set(tr.step)
        M.POLICY_VERSION.set(max(tr.policy_version, 0))
        if self.publisher is not None and (resumed or floor > tr.policy_version):
            log.info(
                "publishing the %s weights before training (learner v%d, floor v%d)",
                "resumed" if resumed else "initial",
                tr.policy_version,
                floor,
            )
            await tr.publish()
        await self._announce(max(tr.publishing.last_step, 0) if self.publisher else tr.step)
        await self._status()

    def _on_served(self, version: int, step: int) -> None:
        """Rank 0's publish thread, right at the ack: the one announcement of ``version``
        (policy version, served step, the feeder woken; actors and the feeder may use the
        new weights at once). ``_on_publish`` announces only if this one failed."""
        if self._sync_redis is None:
            self._sync_redis = redis.Redis.from_url(
                self.s.redis_url, socket_timeout=10.0, socket_connect_timeout=5.0
            )
        try:
            accounting.announce_served_sync(
                self._sync_redis, self.keys, version, step, self.s.batch_size
            )
            self._announced = max(self._announced, version)
        except (redis.RedisError, OSError) as e:  # _on_publish announces it instead
            log.warning("cannot announce served v%d: %s", version, e)

    async def _announce(self, served_step: int) -> None:
        """Rank 0: tell admission control (libludic/staleness.py) the served step and the
        batch size, which wakes the feeder."""
        if self.rank != 0 or self.r is None:
            return
        await transport.retry_redis(
            lambda: accounting.set_admission(self.r, self.keys, served_step, self.s.batch_size),
            deadline_s=60,
            stop=self.stop,
        )

    # ------------------------------------------------------------------ publish / commit

    async def _on_publish(self, version: int, error: str | None, seconds: float) -> None:
        if error is not None:
            M.PUBLISHES.labels(outcome="failed").inc()
            return
        M.PUBLISHES.labels(outcome="ok").inc()
        M.PUBLISH_SECONDS.observe(seconds)
        if self.publisher is not None:
            M.PUBLISH_BYTES.inc(self.publisher.last_bytes)
        M.POLICY_VERSION.set(version)
        if self.rank == 0 and self._announced < version:  # the thread's announcement failed
            await transport.retry_redis(
                lambda: transport.set_policy_version(self.r, self.keys, version),
                deadline_s=60,
                stop=self.stop,
            )
            assert self.trainer is not None
            await self._announce(self.trainer.publishing.last_step)

    async def _replica_behind(self) -> bool:
        """Rank 0, while the source waits for items: does a reachable replica serve an older
        version than the learner published? (An inference container that restarted serves
        its base weights at version 0; actors then wait on max_lag, no fresh item comes, and
        without this the next publish, after the next step, would never come.)"""
        tr = self.trainer
        if tr is None or self.publisher is None or tr.publishing.served_version <= 0:
            return False
        urls = self.publisher.replicas.resolve()
        vs = await asyncio.to_thread(replica_versions, urls, 5.0, self.s.token())
        behind = {u: v for u, v in vs.items() if v is not None and v < tr.publishing.served_version}
        if behind:
            log.warning(
                "replica(s) %s serve older weights than the learner's v%d; republishing",
                ", ".join(f"{u} (v{v})" for u, v in behind.items()),
                tr.publishing.served_version,
            )
            M.REPUBLISHES.inc()
        return bool(behind)

    async def _on_idle(self) -> None:
        """Every rank, while the source waits without a batch: when rank 0 finds a replica
        behind, publish the current weights again (the gather is collective)."""
        assert self.trainer is not None
        behind = self.rank == 0 and await self._replica_behind()
        if parallel.is_distributed():
            behind = ranks.any_rank(behind, self.device)
        if behind:
            await self.trainer.publish()

    async def _on_checkpoint(self, path: Path | None, committed: int) -> None:
        M.CHECKPOINTS.inc()
        if self.rank == 0:
            log.info("checkpoint %s saved; acked %d items", path, committed)

    async def _status(self) -> None:
        if self.rank != 0 or self.r is None:
            return
        tr = self.trainer
        assert tr is not None
        info = {
            "pid": os.getpid(),
            "step": tr.step,
            "policy_version": tr.policy_version,
            "replicas": dict(self.publisher.acked) if self.publisher else {},
            "publish_failures": tr.publishing.failures,
            "consecutive_publish_failures": tr.publishing.consecutive_failures,
            "last_publish_error": tr.publishing.last_error,
            "items_trained": self.source.items_trained,
            "stale_dropped": self.source.stale_dropped,
            "uncommitted": self.source.uncommitted,
        }
        try:
            await transport.set_learner_step(self.r, self.keys, tr.step)
            await transport.beat(
                self.r, self.keys, "learner", self.s.consumer, HEARTBEAT_TTL_S, info
            )
            self.accounting = await accounting.snapshot(self.r, self.keys)
            M.export_accounting(self.accounting)
        except transport.REDIS_DOWN_ERRORS as e:
            log.warning("cannot write learner status to Redis: %s", e)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_TTL_S / 4)
            await self._status()

    # ------------------------------------------------------------------ loop

    async def _on_trained(self, step: int, ids: list[str]) -> None:
        # before the step's checkpoint/commit: a kill -9 between the two must not leave
        # committed items out of the log (resume cuts the log back to the checkpoint)
        self._log_trained(step, ids)

    def _snapshot(self, step: int) -> None:
        """Every ``snapshot_every`` steps (collective: every rank gathers), rank 0 writes
        ``<output_dir>/snapshots/step_N.safetensors`` and a line of ``snapshots.jsonl``
        (step, wall-clock time, RL wall, served version) for evaluating the run afterwards."""
        s, tr = self.s, self.trainer
        if not s.snapshot_every or not s.output_dir or tr is None or step % s.snapshot_every:
            return
        sd = tr.full_state_dict(rank0_only=True)
        if self.rank != 0:
            return
        out = Path(s.output_dir) / "snapshots"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"step_{step:06d}.safetensors"
        path.write_bytes(to_safetensors_bytes(sd))
        with open(out / "snapshots.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "time": time.time(),
                        "rl_wall_s": round(tr.throughput.rl_wall_s, 4),
                        "path": path.name,
                        "policy_version": tr.policy_version,
                    }
                )
                + "\n"
            )

    async def health(self) -> bool:
        """Healthy while the learner makes progress: a step started or finished, or it
        read the saw stream for items, within ``health_stall_s`` (training runs off the
        event loop, so this answers during a step of any length)."""
        last = self.started_at
        if self.trainer is not None:  # built with its source (_build)
            last = max(last, self.trainer.last_progress, self.source.last_read)
        return time.monotonic() - last < self.s.health_stall_s

    async def _on_step(self, stats: dict[str, float], ids: list[str]) -> None:
        if self.trainer is not None:  # off the event loop, as every gather and save
            await self.trainer.off_loop(self._snapshot, int(stats["step"]))
        if self.rank == 0:
            if self.r is not None and ids:  # its items were resolved: room may have opened
                try:
                    if self.publisher is None:  # nothing to serve: the step is what counts
                        await accounting.set_admission(
                            self.r, self.keys, int(stats["step"]), self.s.batch_size
                        )
                    else:
                        await accounting.wake_admission(self.r, self.keys)
                except transport.REDIS_DOWN_ERRORS as e:  # the feeder polls anyway
                    log.warning("cannot wake the feeder: %s", e)
            M.export_step(stats, declared_stat_keys(self.trainer.algo.loss) if self.trainer else ())
            M.UNCOMMITTED.set(self.source.uncommitted)
            await self._status()  # reads the run accounting
            if self.logger is not None:
                self.logger.step(M.logged_stats(stats, self.accounting))

    def _log_trained(self, step: int, ids: list[str]) -> None:
        if self.rank != 0 or self.trained_log is None:
            return
        tr = self.trainer
        line = json.dumps(
            {"step": step, "items": ids, "policy_version": tr.policy_version if tr else 0}
        )
        with open(self.trained_log, "a") as f:
            f.write(line + "\n")

    async def run(self) -> int:
        s = self.s
        await self.setup()
        tr = self.trainer
        assert tr is not None
        if self.rank == 0:
            self.logger = M.StepLogger(
                s.trackers,
                run_id=s.run_id,
                config=run_config(s.config_path, redacted(s)),
                output_dir=s.output_dir,
            )
        keep = asyncio.create_task(self._keepalive()) if self.rank == 0 else None
        reason = "done"
        try:
            await tr.train(
                max(s.num_steps - tr.step, 0) if s.num_steps else None, should_stop=self.stop.is_set
            )
            reason = "done" if tr.stop_reason == "done" else "signal"
            await tr.finish_publish()  # the last step's publish may still be in flight
            if (
                reason == "done"
                and self.publisher is not None
                and tr.publishing.last_step != tr.step
            ):
                await tr.publish()
            if tr.checkpointer is None:
                await tr.commit()
            else:
                await tr.checkpoint()
            await tr.off_loop(self._save_final)
            if reason == "done" and not self.final_policy_served():
                # the run trained, but inference never served what it trained: not a success
                reason = "final_policy_not_served"
                raise LearnerFatal(
                    f"the final policy (step {tr.step}) was never served: inference serves "
                    f"v{tr.policy_version}; {tr.publishing.failures} publish(es) failed, the last "
                    f"with: {tr.publishing.last_error or '?'}"
                )
            if self.rank == 0:
                log.info(
                    "learner stopping (%s) at step %d, policy v%d, %d items trained, %d stale dropped",
                    reason,
                    tr.step,
                    tr.policy_version,
                    self.source.items_trained,
                    self.source.stale_dropped,
                )
            return 0
        except PublishFailed as e:
            if tr.checkpointer is not None:
                try:
                    await tr.checkpoint()
                except Exception as ce:  # keep the original error; the checkpoint is best effort
                    log.error("checkpoint after a fatal error failed: %s", ce)
            raise LearnerFatal(str(e)) from e
        finally:
            if keep is not None:
                keep.cancel()
                await asyncio.gather(keep, return_exceptions=True)
            await self._status()
            self._write_final(reason)
            if self.logger is not None:
                self.logger.close()

    def final_policy_served(self) -> bool:
        """True when no inference replica is configured (nothing to serve) or the last
        successful publish carried the weights of the current step."""
        tr = self.trainer
        return self.publisher is None or (tr is not None and tr.publishing.last_step == tr.step)

    def _save_final(self) -> None:
        """``<output_dir>/final/``: the policy at a clean exit (after the final publish, so
        the weights the replicas hold unless that publish failed) as a Hugging Face model
        directory with model_dir's tokenizer, loadable by ``from_pretrained``. Collective
        under FSDP2 (every rank gathers); rank 0 writes ``final.tmp`` and renames it, so
        ``final/`` is always complete."""
        tr = self.trainer
        if tr is None or not self.s.output_dir:
            return
        sd = tr.full_state_dict(rank0_only=True)
        if self.rank != 0:
            return
        out = Path(self.s.output_dir) / "final"
        tmp = out.with_name("final.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model: Any = tr.model
        if is_peft(model):  # LoRA: sd already holds the merged base weights
            model = model.get_base_model()
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.s.model_dir).save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
        log.info("saved the final policy (step %d, v%d) to %s", tr.step, tr.policy_version, out)

    def _write_final(self, reason: str) -> None:
        """``<output_dir>/learner_final.json``: the counters at exit, for launchers and
        benches (a scrape of /metrics can miss the last steps of a short run)."""
        tr = self.trainer
        if self.rank != 0 or tr is None or not self.s.output_dir:
            return
        out = Path(self.s.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        final = {
            "reason": reason,
            "step": tr.step,
            "policy_version": tr.policy_version,
            "items_trained": self.source.items_trained,
            "stale_dropped": self.source.stale_dropped,
            "nonfinite_steps_skipped": tr.nonfinite_skipped_total,
            "rl_wall_seconds": round(tr.throughput.rl_wall_s, 3),
            # mean seconds per step: waiting for items, training, publishing, all of it
            "step_profile": {
                k: round(v / max(tr.step, 1), 4) for k, v in tr.throughput.time_totals.items()
            },
            "samples_per_second": round(tr.throughput.samples_per_s, 2)
            if tr.throughput.rl_wall_s > 0
            else None,
            # the spare-core training thread (libludic/training/spare_core.py), when used
            "spare_core": None
            if tr.spare is None
            else {
                "cores": list(tr.spare.cores),
                "micro_batches": tr.spare.micro_batches_total,
                "taken_back": tr.spare.taken_back_total,
                "stopped": tr.spare.broken,
            },
            # the model as trained: activations recomputed (algorithm.gradient_checkpointing)
            "gradient_checkpointing": tr.cfg.gradient_checkpointing,
            "publish_failures": tr.publishing.failures,
            "last_publish_error": tr.publishing.last_error,
            "final_policy_served": self.final_policy_served(),
            "accounting": self.accounting,  # libludic/transport/accounting.py, read at the last status
        }
        tmp = out / "learner_final.json.tmp"
        tmp.write_text(json.dumps(final))
        tmp.replace(out / "learner_final.json")

    async def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self._sync_redis is not None:
            self._sync_redis.close()
        if self.r is not None:
            await self.r.aclose()
