"""``ludic learner``: saw stream -> Trainer (FSDP2 under torchrun) -> publish -> checkpoint.

    ludic learner --model-dir DIR --inference-urls http://inference:8000 [--resume]
    torchrun --nproc_per_node N -m services.cli learner ...      # FSDP2, gloo/NCCL

``run()`` joins the torchrun process group, builds the :class:`Learner`
(services/learner/worker.py: the wiring around the library's ``Trainer.train``), serves
``/health`` and ``/metrics`` (:func:`run`: which rank serves what) and runs it until
``num_steps`` or ``stop``; ``main()`` is the entry point (exit 0 drained, 1 fatal such as
``LearnerFatal``, 2 bad settings). The guarantees (exactly-once effect, staleness,
publishing, versions, SIGTERM): services/learner/README.md, "Guarantees".
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
    """Run the learner until ``num_steps`` or ``stop``; returns it (for tests/benches).

    Nodes. A torchrun job may span several machines (``torchrun --nnodes N --rdzv_backend
    c10d --rdzv_endpoint HOST:PORT``; the Helm chart's ``learner.nodes``). Global rank 0
    does what one rank does (Redis, publishing, checkpoints, ``/metrics``); the first rank
    of every other node serves ``/health`` on ``metrics_port`` (its ``/metrics`` empty), so
    a probe of any node answers. Only rank 0 loads the model from ``model_dir`` and reads
    checkpoints: the other ranks receive their shards by broadcast, so ``output_dir`` need
    only be on rank 0's node."""
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
