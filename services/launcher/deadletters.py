"""Dead letters as ``ludic up`` follows them: a failing task stops the run, the learner's
dropped items are counted.

Every actor counts its resolved requests per task and outcome
(``ludic_actor_task_requests_total{task, outcome}``: ``committed`` or ``deadlettered``).
``TaskFailureWatch`` follows those counters across every actor's scrapes: a task's streak
is its requests dead-lettered since its last committed one; a streak of ``threshold`` (up.
``deadletter_stop_after``) means the task is failing for good (a bug in its env or reward
function, a verifier that is down, requests that name no task of the run), and ``ludic up``
stops instead of dead-lettering until its timeout. ``first_reason`` reads the dead-letter
stream for the reason of that task's first dead letter, which goes to the log, the live view
and summary.json.

``DeadLetterTally`` counts the learner's dead letters (the entries moved from the saw
stream) by reason as they arrive, and among the ``unusable_item`` ones the items that cannot
fit ``learner.max_seq_len``: the live view and summary.json show both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from libludic import transport

_SERIES = re.compile(r"ludic_actor_task_requests_total\{outcome=(\w+),task=(.*)\}")
NO_TASK = "(none)"  # what an actor counts a request under that is no task of its run
UNUSABLE = "unusable_item"  # the learner's reason for an item no step could train
# how the learner's detail of an item too long for max_seq_len reads (libludic/training/
# collate.py truncation_offset; tests/unit/test_launcher_deadletters.py reads one it wrote)
TOO_LONG = "cannot fit max_seq_len"


class TaskFailureWatch:
    def __init__(self, threshold: int) -> None:
        if threshold < 0:
            raise ValueError(f"deadletter_stop_after={threshold} must be >= 0 (0: off)")
        self.threshold = threshold
        self._last: dict[tuple[str, str, str], float] = {}  # (actor, task, outcome) -> count
        self.streak: dict[str, float] = {}  # task -> dead-lettered since its last commit

    def update(self, scrapes: Mapping[str, Mapping[str, float]]) -> None:
        """Take one scrape of every actor (``actor -> {series: value}``; an actor that did
        not answer is left out). A counter below its last value is a restarted actor's,
        counted from 0."""
        delta: dict[tuple[str, str], float] = {}
        for actor, metrics in scrapes.items():
            for series, value in metrics.items():
                m = _SERIES.fullmatch(series)
                if m is None:
                    continue
                outcome, task = m.groups()
                prev = self._last.get((actor, task, outcome), 0.0)
                self._last[(actor, task, outcome)] = value
                d = value - prev if value >= prev else value
                delta[(task, outcome)] = delta.get((task, outcome), 0.0) + d
        for task in {t for t, _ in delta}:
            if delta.get((task, "committed"), 0.0) > 0:
                self.streak[task] = 0.0
            else:
                self.streak[task] = self.streak.get(task, 0.0) + delta.get(
                    (task, "deadlettered"), 0.0
                )

    def failing(self) -> list[tuple[str, int]]:
        """(task, requests dead-lettered in a row) of every task past the threshold."""
        if self.threshold == 0:
            return []
        return [(t, int(n)) for t, n in sorted(self.streak.items()) if n >= self.threshold]


def task_of(fields: Mapping[bytes, Any]) -> str | None:
    """The task a dead-letter entry of the requests stream belongs to (None: not one, or
    its payload was not kept)."""
    if transport.as_str(fields.get(b"source_stream", b"")).rsplit(":", 1)[-1] != "requests":
        return None
    try:
        req = transport.decode_request(fields.get(b"d", b""))
    except transport.CodecError:
        return None
    return str(req.meta.get("task", NO_TASK))


def first_reason(r: Any, keys: transport.Keys, task: str, scan: int = 5000) -> str:
    """``reason: detail`` of ``task``'s first dead letter (sync Redis client ``r``), read
    from the start of the dead-letter stream (at most ``scan`` entries). ``NO_TASK``: the
    first request an actor found to be no task of its run."""
    for f in transport.deadletters_sync(r, keys, scan):
        reason = transport.as_str(f.get(b"reason", b"?"))
        if task == NO_TASK and reason != "not_a_task":
            continue
        if task != NO_TASK and (reason == "not_a_task" or task_of(f) != task):
            continue
        return f"{reason}: {transport.as_str(f.get(b'detail', b''))}"
    return "(no dead-letter entry of it found)"


class DeadLetterTally:
    """The learner's dead letters by reason (``by_reason``), read from the dead-letter stream
    of ``keys`` since the last look; ``too_long``: the ``unusable_item`` ones whose detail
    says the item cannot fit ``learner.max_seq_len``. The stream is capped (about 10,000
    entries): entries trimmed before a look are not counted."""

    def __init__(self, keys: transport.Keys) -> None:
        self.keys = keys
        self.last_id = "0-0"  # the newest entry read
        self.by_reason: dict[str, int] = {}
        self.too_long = 0

    @property
    def unusable(self) -> int:
        return self.by_reason.get(UNUSABLE, 0)

    def add(self, fields: Mapping[bytes, Any]) -> None:
        """Count one dead-letter entry (its fields) if the learner wrote it."""
        if transport.as_str(fields.get(b"source_stream", b"")) != self.keys.saw:
            return
        reason = transport.as_str(fields.get(b"reason", b"?"))
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if reason == UNUSABLE and TOO_LONG in transport.as_str(fields.get(b"detail", b"")):
            self.too_long += 1

    def update(self, r: Any, batch: int = 1000) -> None:
        """Count the entries written since the last look (sync Redis client ``r``)."""
        while True:
            entries = transport.deadletters_after_sync(r, self.keys, self.last_id, batch)
            for entry_id, fields in entries:
                self.add(fields)
                self.last_id = entry_id
            if len(entries) < batch:
                return
