"""Admission: which SAWItems an optimizer step may train, decided in one place.

Two verdicts, one method each: :meth:`Admission.problem` (why the stepper cannot train an
item: out-of-vocabulary ids, a sequence over the model's length...; such an item is
dead-lettered, never trained) and :meth:`Admission.split_stale` (``libludic.staleness``:
kept iff ``v >= version - max_lag``; no version: kept).

The Trainer builds one over its publisher (the version) and its stepper (the problems). A
source that reads items itself (PipelineBatchSource, an :class:`AdmittingBatchSource`) is
handed it and judges as it forms batches, at rank 0's served version (known the moment the
publish thread has it); the Trainer then judges nothing again. Any other source's items are
judged by the Trainer at the start of the step, at the version every rank agrees on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from libludic import staleness
from libludic.saw import SAWItem

T = TypeVar("T")


class ServedVersions(Protocol):
    """The publisher's counters (libludic.training.publishing.VersionedPublisher)."""

    @property
    def version(self) -> int: ...  # acknowledged, known on every rank

    @property
    def served_version(self) -> int: ...  # rank 0's view, as soon as the publish thread has it


class ChecksItems(Protocol):
    """What can train an item (libludic.training.step.OptimizerStep)."""

    def item_problem(self, item: SAWItem) -> str | None: ...


@dataclass
class Admission:
    """Staleness under ``max_lag`` (None: off) at ``versions``' version, and ``checker``'s
    problems (None: every item is trainable)."""

    max_lag: int | None = None
    versions: ServedVersions | None = None
    checker: ChecksItems | None = None

    def __post_init__(self) -> None:
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"max_lag={self.max_lag} must be >= 0 or None")

    def problem(self, item: SAWItem) -> str | None:
        """Why ``item`` can never be trained (None: it can)."""
        return None if self.checker is None else self.checker.item_problem(item)

    def split_stale(
        self, entries: Sequence[T], item_of: Callable[[T], SAWItem], served: bool = True
    ) -> tuple[list[T], list[T]]:
        """``entries`` split into (fresh, stale), order kept: judged at the served version
        (rank 0, a source forming batches) or, ``served=False``, at the acknowledged one
        (every rank, the Trainer)."""
        v = self.versions
        version = 0 if v is None else (v.served_version if served else v.version)
        return staleness.split_stale(
            entries, lambda e: item_of(e).policy_version, version, self.max_lag
        )


@runtime_checkable
class AdmittingBatchSource(Protocol):
    """A source that judges its items with the Trainer's :class:`Admission` before they
    reach a batch (the Trainer sets ``admission`` when it is built)."""

    admission: Admission
