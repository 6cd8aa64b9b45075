"""A second training thread on cores that other work owns, at idle priority.

On a machine without a GPU the learner trains on its own core while generation (vLLM, the
actors, credit) runs on the others, and generation leaves gaps: it waits for new weights,
for requests, for the event loop. :class:`SpareCoreHelper` is a thread pinned to those
other cores with the ``SCHED_IDLE`` policy: the kernel runs it only when nothing else wants
them, so it takes no time from generation, and in the gaps it trains.

One optimizer step's micro-batches are shared out by :meth:`SpareCoreHelper.run`. The
training thread and the helper take them in order from one counter. The training thread
writes its gradients into ``p.grad`` as usual; the helper computes its own with
``torch.autograd.grad`` (nothing it does touches ``p.grad``) and adds them to a private
buffer once the micro-batch is its for good. When the training thread runs out of
micro-batches while the helper is still on one, it takes that one back and computes it
itself: a helper starved of CPU never makes a step wait, and a step is never slower than
the training thread alone by more than the bookkeeping. The helper's unfinished work is
then thrown away (it may read weights the optimizer is changing; nothing of it is kept).

The gradient is the same sum of the same micro-batch gradients as without the helper, in
another order: equal up to float rounding. Off by default (``TrainerConfig.spare_cores``);
``ludic up`` turns it on when it pins the learner to cores of its own (launcher/cpus.py).
Not used under FSDP2 (its hooks are per rank, not per thread), with gradient checkpointing,
or on a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

# (result, gradients or None per parameter) of one micro-batch computed by the helper
HelperOut = tuple[Any, Sequence[torch.Tensor | None]]


@dataclass
class _Job:
    n: int
    helper_fn: Callable[[int], HelperOut]
    next: int = 0  # the next micro-batch nobody has taken
    held: int | None = None  # the one the helper is computing
    committing: bool = False  # the helper is adding its gradients to buf
    closed: bool = False  # the training thread is done: the helper takes nothing more
    buf: list[torch.Tensor | None] | None = None  # the helper's summed gradients
    failed: list[int] = field(default_factory=list)  # raised in the helper: computed again
    results: dict[int, Any] = field(default_factory=dict)


class SpareCoreHelper:
    """The helper thread (see the module docstring). ``micro_batches_total`` counts the
    micro-batches whose gradients it contributed, ``taken_back_total`` those the training
    thread took back from it."""

    def __init__(self, cores: Sequence[int]) -> None:
        if not cores:
            raise ValueError("SpareCoreHelper needs at least one core")
        self.cores = tuple(sorted(set(int(c) for c in cores)))
        self._cv = threading.Condition()
        self._job: _Job | None = None
        self._closed = False
        self.micro_batches_total = 0
        self.taken_back_total = 0
        self.placement = ""  # how the thread got placed, for the log
        self.broken = ""  # set when a micro-batch raised in the helper: it takes no more
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ludic-spare-core", daemon=True)
        self._thread.start()
        self._ready.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _place(self) -> None:
        """Pin this thread to the spare cores at idle priority (Linux: both are per thread)."""
        parts = []
        try:
            os.sched_setaffinity(0, self.cores)
            parts.append(f"cores {list(self.cores)}")
        except (AttributeError, OSError, ValueError) as e:
            parts.append(f"not pinned ({e})")
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            parts.append("SCHED_IDLE")
        except (AttributeError, OSError) as e:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, 19)
                parts.append(f"nice 19 (no SCHED_IDLE: {e})")
            except (AttributeError, OSError) as e2:
                parts.append(f"normal priority ({e2})")
        self.placement = ", ".join(parts)

    def _loop(self) -> None:
        self._place()
        self._ready.set()
        while True:
            with self._cv:
                while not self._closed and (
                    self.broken
                    or self._job is None
                    or self._job.closed
                    or self._job.next >= self._job.n
                ):
                    self._cv.wait()
                if self._closed:
                    return
                job = self._job
                assert job is not None
                i = job.next
                job.next += 1
                job.held = i
            try:
                result, grads = job.helper_fn(i)
            except Exception as e:  # noqa: BLE001 - the training thread computes it again
                with self._cv:
                    if job.held == i:
                        # the same micro-batch would raise here again: the helper stops
                        # taking work, the training thread computes it (and raises, if it does)
                        self.broken = f"{type(e).__name__}: {e}"
                        log.warning(
                            "spare-core helper stopped: micro-batch %d raised %s; the training "
                            "thread computes it and every later one",
                            i,
                            self.broken,
                        )
                        job.failed.append(i)
                        job.held = None
                    self._cv.notify_all()
                continue
            with self._cv:
                if job.held != i:  # taken back: thrown away
                    self._cv.notify_all()
                    continue
                job.committing = True
            try:
                if job.buf is None:
                    job.buf = [None if g is None else g.detach() for g in grads]
                else:
                    for k, g in enumerate(grads):
                        if g is None:
                            continue
                        cur = job.buf[k]
                        job.buf[k] = g.detach() if cur is None else cur.add_(g)
                job.results[i] = result
            finally:
                with self._cv:
                    job.held = None
                    job.committing = False
                    self.micro_batches_total += 1
                    self._cv.notify_all()

    def run(
        self,
        n: int,
        main_fn: Callable[[int], Any],
        helper_fn: Callable[[int], HelperOut],
    ) -> tuple[list[Any], list[torch.Tensor | None] | None]:
        """Compute micro-batches ``0..n-1``: ``main_fn(i)`` on the calling thread (it writes
        ``p.grad`` itself), ``helper_fn(i)`` on the helper (returns its result and its
        gradients). Returns every micro-batch's result, in order, and the sum of the
        helper's gradients (None if it contributed none): the caller adds it to ``p.grad``."""
        job = _Job(n=n, helper_fn=helper_fn)
        with self._cv:
            self._job = job
            self._cv.notify_all()
        try:
            while True:
                with self._cv:
                    if job.next < n:
                        i = job.next
                        job.next += 1
                    elif job.failed:
                        i = job.failed.pop()
                    elif job.committing:
                        self._cv.wait()
                        continue
                    elif job.held is not None:
                        i = job.held  # take it back: the helper's copy will be thrown away
                        job.held = None
                        self.taken_back_total += 1
                    else:
                        break
                job.results[i] = main_fn(i)
        finally:  # done, or main_fn raised: the helper takes nothing more of this step
            with self._cv:
                job.closed = True
                if self._job is job:
                    self._job = None
        return [job.results[i] for i in range(n)], job.buf


def spare_core_helper(
    cores: Sequence[int] | None,
    *,
    distributed: bool,
    device: torch.device,
    gradient_checkpointing: bool,
) -> SpareCoreHelper | None:
    """The helper thread on ``cores`` for a Trainer, when it can be used (None: no cores,
    or a setting it cannot work with, logged)."""
    if not cores:
        return None
    why = ""
    if distributed:
        why = "FSDP2 shards the model per rank"
    elif device.type != "cpu":
        why = f"training on {device}"
    elif gradient_checkpointing:
        why = "gradient checkpointing is on"
    if why:
        log.info("spare cores %s not used: %s", list(cores), why)
        return None
    helper = SpareCoreHelper(cores)
    log.info("spare-core training thread: %s", helper.placement)
    return helper


def spare_core_grads(
    loss: torch.Tensor, params: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The gradients of ``loss`` for ``params`` without touching ``p.grad``."""
    return list(torch.autograd.grad(loss, list(params), allow_unused=True))
