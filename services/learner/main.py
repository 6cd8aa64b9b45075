"""``ludic learner``: saw stream -> Trainer (FSDP2 under torchrun) -> publish -> checkpoint.

    ludic learner --model-dir DIR --inference-urls http://inference:8000 [--resume]
    torchrun --nproc_per_node N -m services.cli learner ...      # FSDP2, gloo/NCCL

The loop is the library's (``Trainer.train``: batch, stale filter, step, publish, checkpoint
and commit, stop conditions; ``Trainer`` is the only writer of the policy version); this
module wires settings, Redis and metrics into it: ``PipelineBatchSource`` (rank 0 reads
Redis, shares the batch; it drops stale items before batching, at the Trainer's
``max_lag`` and version), the publisher, the checkpoint manager and ``TrainerHooks``
(metrics, the version in Redis, the status entry, the trained-items log). The full state
dict is gathered only for a publish or a checkpoint.

Nodes. A torchrun job may span several machines (``torchrun --nnodes N --rdzv_backend c10d
--rdzv_endpoint HOST:PORT``; the Helm chart's ``learner.nodes``). Global rank 0 does what one
rank does (Redis, publishing, checkpoints, ``/metrics``); the first rank of every other node
serves ``/health`` on ``metrics_port`` (its ``/metrics`` empty), so a probe of any node
answers. Only rank 0 loads the model from ``model_dir`` and reads checkpoints: the other
ranks receive their shards by broadcast, so ``output_dir`` need only be on rank 0's node.

Exactly-once. Items are acked only once committed: with checkpointing, when a checkpoint
that includes them is saved (its extra holds ``batch_source.last_committed_id``,
``items_trained``, ``policy_version``, ``trainer_step``); without, right after their step.
``--resume`` loads the newest complete checkpoint (model, optimizer, step, RNG, policy
version, stream position) and re-reads this consumer's pending entries first, so every
item trained after that checkpoint is trained again exactly once, in the same batches.
With ``output_dir`` set, ``trained_items.jsonl`` lists each committed-or-current step's
item ids; on start it is cut back to the resumed step, so it always describes the history
of the weights being trained.

Versions. A publish labels the weights ``max(learner version, floor) + 1`` where ``floor``
is the highest version seen at start-up in Redis or on any replica (so a restarted
learner never publishes a version the replicas refuse as old). At start-up the learner
publishes its current weights if it resumed or if Redis/the replicas are ahead of it, so
inference serves what the learner trains. After a successful publish the version goes to
Redis (``ludic:{run}:policy_version``, which actors' admission control reads).

Publish failure policy. A publish that some replica did not acknowledge (after bounded
retries, see libludic/distributed/publisher.py) does **not** stop training: the error is
logged, counted (``ludic_learner_publishes_total{outcome="failed"}``,
``ludic_learner_publish_failures_total{replica}``), the old version stays in Redis and
the learner's served version does not move; the next publish sends newer weights under a
new number (a number is never reused: a replica that took the failed one must not hold
other weights than its peers under it; libludic/training/trainer.py). After
``max_publish_failures`` consecutive failures the learner saves a checkpoint (if enabled)
and exits 1, so an orchestrator notices. Without ``inference_urls`` nothing is published.

SIGTERM/SIGINT: finish the current step, checkpoint if enabled (acking what it commits),
exit 0. ``num_steps`` reached: final publish (if the last step did not publish) and final
checkpoint, exit 0. A clean exit with ``output_dir`` set saves the policy as a Hugging Face
model directory ``<output_dir>/final/``. Rank 0 serves /metrics on ``metrics_port`` and writes
``learner_step``, ``policy_version`` and a ``heartbeat:learner:{consumer}`` status entry
(replica versions, publish failures) to Redis.
"""

from __future__ import annotations

import asyncio
import logging
import os

import torch.distributed as dist
from prometheus_client import CollectorRegistry

from libludic.training import parallel
from services.common.http import start_http
from services.common.skeleton import service_main
from services.learner.settings import LearnerSettings
from services.learner.worker import (  # noqa: F401 (re-exported for callers of main)
    Learner,
    LearnerFatal,
    init_distributed,
)

log = logging.getLogger("ludic.learner")


async def run(settings: LearnerSettings, *, stop: asyncio.Event | None = None) -> Learner:
    """Run the learner until ``num_steps`` or ``stop``; returns it (for tests/benches)."""
    stop = stop or asyncio.Event()
    init_distributed(settings.device)
    learner = Learner(settings, stop)
    server = None
    if learner.rank == 0:
        server = await start_http(settings.metrics_port, learner.health, host=settings.metrics_host)
    elif int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # the first rank of another node (pod): /health for its probes; the metrics are rank 0's
        server = await start_http(
            settings.metrics_port, learner.health, CollectorRegistry(), settings.metrics_host
        )
    try:
        await learner.run()
    finally:
        if server is not None:
            server.close()
        await learner.close()
    return learner


def _leave_process_group() -> None:
    if parallel.is_distributed():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return service_main(
        "learner",
        LearnerSettings,
        run,
        argv,
        description="FSDP2 learner: saw stream -> Trainer -> publish to inference",
        log_config=int(os.environ.get("RANK", "0")) == 0,
        fatal=(LearnerFatal,),
        cleanup=_leave_process_group,
    )


if __name__ == "__main__":
    raise SystemExit(main())
