"""The Trainer's batch-source contract: where its batches come from and how a source says
that a stop was requested. The items themselves are plain data in ``libludic.saw``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from libludic.saw import SAWBatch


@runtime_checkable
class BatchSource(Protocol):
    async def next_batch(self) -> SAWBatch: ...


class SourceStopped(Exception):
    """Raised by a BatchSource's ``next_batch`` (on every rank) once a stop was requested:
    ``Trainer.train`` ends there, as on its own ``should_stop``."""
