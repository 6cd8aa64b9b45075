"""What a service wires into the Trainer's loop (TrainerHooks) and the default console line."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("libludic.training.trainer")


def console_log(stats: dict[str, float], policy_version: int) -> None:
    """The Trainer's default ``on_log``: one console line of a step's stats."""
    log.info(
        "step %d loss %.4f grad_norm %.3f items %d reward %.3f stale %d tok/s %.0f "
        "samples/s %.1f v%d (wait %.3fs train %.3fs publish %.3fs)",
        int(stats["step"]),
        stats["loss"],
        stats["grad_norm"],
        int(stats["batch_items"]),
        stats["reward_mean"],
        int(stats["stale_dropped_total"]),
        stats["tokens_per_s"],
        stats["samples_per_s"],
        policy_version,
        stats["batch_wait_s"],
        stats["train_s"],
        stats["publish_wait_s"],
    )


@dataclass
class TrainerHooks:
    """What a service wires into the loop; each hook is optional and awaited on every rank
    (rank-0-only work, such as writing to Redis, is the hook's own business).

    on_trained(step, item_ids)        right after the update, before publish/checkpoint/commit
                                      (a record of trained items must precede their commit)
    on_step(stats, item_ids)          after each step (ids: the batch source's, all ranks)
    on_publish(version, error, secs)  after each publish, once its outcome is applied (the
                                      next publish or ``finish_publish``); error None = served
    on_checkpoint(path, committed)    after each checkpoint (path None on ranks > 0)
    on_served(version, step)          NOT a coroutine: called on rank 0 in the publish thread
                                      the moment replicas acknowledged ``version`` (the weights
                                      of ``step``), while training goes on; keep it short and
                                      thread-safe (e.g. tell admission control: the next
                                      batches may be generated on these weights)
    on_idle()                         while the batch source waits without a batch
                                      (SourceIdle), at the same point on every rank, so it
                                      may be collective (the learner republishes when a
                                      replica came back on older weights)
    on_log(stats, policy_version)     NOT a coroutine: on rank 0 every ``cfg.log_every``
                                      steps, after ``on_trained``; by default
                                      :func:`console_log` (one line per step); None: silent
    """

    on_trained: Callable[[int, list[str]], Awaitable[None]] | None = None
    on_step: Callable[[dict[str, float], list[str]], Awaitable[None]] | None = None
    on_publish: Callable[[int, str | None, float], Awaitable[None]] | None = None
    on_checkpoint: Callable[[Path | None, int], Awaitable[None]] | None = None
    on_served: Callable[[int, int], None] | None = None
    on_idle: Callable[[], Awaitable[None]] | None = None
    on_log: Callable[[dict[str, float], int], None] | None = console_log
