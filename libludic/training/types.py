"""The Trainer's batch-source contracts: where its batches come from, how a source that
owns durable items (Redis entries) learns what was trained and commits it, what it saves in
a checkpoint, and how a source says that a stop was requested or that it is idle. The items themselves are
plain data in ``libludic.saw``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from libludic.saw import SAWBatch


@runtime_checkable
class BatchSource(Protocol):
    async def next_batch(self) -> SAWBatch: ...


@runtime_checkable
class CommittingBatchSource(BatchSource, Protocol):
    """A source whose items must be acknowledged once trained (PipelineBatchSource).

    After each optimizer step the Trainer calls ``mark_trained()`` (the ids of the batch it
    just trained, in order; they count as trained from then on) and, once the step's
    checkpoint is saved, ``commit()`` (acknowledge every item marked so far; returns how
    many). ``stale_dropped`` counts the items the source itself dropped as too old before
    they reached a batch (the Trainer adds its own drops to it in its stats)."""

    stale_dropped: int

    def mark_trained(self) -> list[str]: ...

    async def commit(self) -> int: ...


@runtime_checkable
class CheckpointedBatchSource(BatchSource, Protocol):
    """A source with state of its own to save in the Trainer's checkpoint (read positions,
    counters); ``load_state_dict`` gets back what ``state_dict`` returned."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SourceStopped(Exception):
    """Raised by a BatchSource's ``next_batch`` (on every rank) once a stop was requested:
    ``Trainer.train`` ends there, as on its own ``should_stop``."""


class SourceIdle(Exception):
    """Raised by a BatchSource's ``next_batch`` (on every rank, at the same point) when it
    has waited a while without a batch: the caller may run idle work, collective included
    (the Trainer awaits ``hooks.on_idle``), then asks again. Nothing is lost."""


def check_contract(source: Any) -> None:
    """A source with part of a contract's methods would be taken for one without it (its
    items never committed, its state never saved): refuse it by name."""
    for proto, members in (
        (CommittingBatchSource, ("stale_dropped", "mark_trained", "commit")),
        (CheckpointedBatchSource, ("state_dict", "load_state_dict")),
    ):
        has = [m for m in members if hasattr(source, m)]
        if has and len(has) < len(members):
            missing = [m for m in members if m not in has]
            raise TypeError(
                f"batch source {type(source).__name__} has {has} but not {missing}: "
                f"implement all of {proto.__name__} ({', '.join(members)}) or none"
            )
