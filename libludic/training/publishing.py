"""The learner's publishing: one version counter, double buffering, the failure policy.

:class:`VersionedPublisher` is the only owner of the policy versions a Trainer knows:

* ``version``: the last version a publish *acknowledged*, on every rank alike: what
  inference serves; staleness and the admission of new episodes are measured against it.
* ``served_version``: rank 0's view of the same, known the moment the publish thread has
  the acknowledgement (``version`` follows at :meth:`finish`).
* ``issued``: the one counter versions are labelled from: the next publish is
  ``issued + 1``. It only rises (a failed publish's number is never reused; a floor read
  from Redis or a replica, or a restored checkpoint, raises it), so no version is labelled
  twice.

A publish is two halves. :meth:`start` finishes the publish in flight, takes the snapshot
(the caller's: it knows the model) and sends it in a background thread; :meth:`finish`
waits for it and applies the outcome on every rank. At most one is in flight: double
buffering. Under torch.distributed every rank runs both halves; the transport is wrapped
in :class:`~libludic.distributed.publisher.Rank0OnlyPublisher` (only rank 0 holds the
gathered weights and sends them) and :meth:`finish` broadcasts rank 0's outcome.

Failure policy: a ``PublishError`` is counted and training goes on with the old version
served (the next publish retries); ``max_failures`` in a row raise :class:`PublishFailed`;
any other error is re-raised on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from libludic.distributed.interfaces import PolicyPublisher
from libludic.distributed.publisher import PublishError, Rank0OnlyPublisher
from libludic.training import parallel
from libludic.training.hooks import TrainerHooks

log = logging.getLogger(__name__)

SERVED, FAILED, UNEXPECTED = 0, 1, 2  # a publish's outcome, as rank 0 broadcasts it


class PublishFailed(RuntimeError):
    """``max_publish_failures`` consecutive publishes failed: training cannot go on."""


@dataclass(frozen=True)
class _InFlight:
    version: int
    step: int  # whose weights it carries
    t0: float  # perf_counter at start: the snapshot's time counts
    task: asyncio.Task[None] | None  # rank 0's send (every rank's under Rank0OnlyPublisher)


class VersionedPublisher:
    def __init__(
        self,
        publisher: PolicyPublisher | None,
        *,
        max_failures: int,
        device: torch.device,
        hooks: TrainerHooks | None = None,
    ) -> None:
        self.distributed = parallel.is_distributed()
        if self.distributed and publisher is not None:
            if not isinstance(publisher, Rank0OnlyPublisher):
                publisher = Rank0OnlyPublisher(publisher)
        self.publisher = publisher
        self.max_failures = max_failures
        self.device = device
        self.hooks = hooks if hooks is not None else TrainerHooks()
        self.version = 0
        self.served_version = 0
        self.issued = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.last_error = ""
        self.last_step = -1  # the step whose weights the last acknowledged publish carried
        self._inflight: _InFlight | None = None

    # ------------------------------------------------------------------ the counter

    def raise_floor(self, floor: int) -> None:
        """Never label a version <= ``floor`` (one Redis or a replica already has)."""
        self.issued = max(self.issued, floor)

    def restore(self, version: int) -> None:
        """A restored checkpoint's acknowledged version (nothing in flight)."""
        self.version = self.served_version = version
        self.issued = max(self.issued, version)

    # ------------------------------------------------------------------ one publish

    async def start(
        self, snapshot: Callable[[], Awaitable[Mapping[str, torch.Tensor]]], step: int
    ) -> None:
        """Finish the publish in flight, then ``snapshot()`` (every rank: the gather is
        collective under FSDP2) and send it as the next version in a background thread."""
        if self.publisher is None:
            raise ValueError("Trainer has no publisher; pass publisher=...")
        await self.finish()
        self.issued += 1
        version = self.issued
        t0 = time.perf_counter()
        sd = await snapshot()
        task = asyncio.create_task(
            asyncio.to_thread(self._send, sd, version, step), name=f"publish-v{version}"
        )
        self._inflight = _InFlight(version, step, t0, task)

    def _send(self, sd: Mapping[str, torch.Tensor], version: int, step: int) -> None:
        """The publish thread: send; on rank 0, tell ``on_served`` at once."""
        assert self.publisher is not None
        self.publisher.publish(sd, version)
        if parallel.rank() != 0:
            return
        self.served_version = max(self.served_version, version)
        if self.hooks.on_served is not None:
            try:
                self.hooks.on_served(version, step)
            except Exception as e:  # the publish itself succeeded; finish() applies it
                log.warning("on_served(v%d) failed: %s", version, e)

    async def finish(self) -> bool | None:
        """Wait for the publish in flight (if any) and apply its outcome on every rank:
        True acknowledged, False failed (counted; :class:`PublishFailed` after
        ``max_failures`` in a row), None when nothing was in flight."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return None
        code, error, unexpected = SERVED, "", None
        if flight.task is not None:
            try:
                await flight.task
            except PublishError as e:
                code, error = FAILED, str(e)
            except Exception as e:  # re-raised below, after every rank heard of it
                code, error, unexpected = UNEXPECTED, f"{type(e).__name__}: {e}", e
        if self.distributed:  # only rank 0 sent: its outcome is everyone's
            flag = torch.tensor([code], dtype=torch.int32, device=self.device)
            dist.broadcast(flag, 0)
            code = int(flag.item())
            if code != SERVED and not error:
                error = "publish failed on rank 0 (see its log)"
        dt = time.perf_counter() - flight.t0
        if code == UNEXPECTED:
            if unexpected is not None:
                raise unexpected
            raise RuntimeError(f"publish of v{flight.version} raised an unexpected error on rank 0")
        if code == FAILED:
            return await self._failed(flight.version, error, dt)
        self.version = flight.version
        self.served_version = max(self.served_version, flight.version)
        self.consecutive_failures = 0
        self.last_step = flight.step
        if parallel.rank() == 0:
            log.info(
                "published policy v%d (weights of step %d) in %.2fs",
                flight.version,
                flight.step,
                dt,
            )
        if self.hooks.on_publish is not None:
            await self.hooks.on_publish(flight.version, None, dt)
        return True

    async def _failed(self, version: int, error: str, dt: float) -> bool:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = error[:1000]
        (log.error if parallel.rank() == 0 else log.debug)(
            "PUBLISH FAILED (%d in a row, limit %d); training continues on v%d weights, "
            "v%d stays served: %s",
            self.consecutive_failures,
            self.max_failures,
            version,
            self.version,
            error,
        )
        if self.hooks.on_publish is not None:
            await self.hooks.on_publish(version, error, dt)
        if self.consecutive_failures >= self.max_failures:
            raise PublishFailed(
                f"{self.consecutive_failures} consecutive publishes failed "
                f"(max_publish_failures={self.max_failures}); last: {error}"
            )
        return False
