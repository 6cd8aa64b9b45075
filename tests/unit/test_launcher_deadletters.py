"""The learner's dead letters counted where users look (services/launcher/deadletters.py
``DeadLetterTally``): by reason, the unusable items too long for ``learner.max_seq_len``
apart, in summary.json (the live view's line: tests/unit/test_live_view.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from libludic.training.collate import untrainable
from libludic.transport import Keys
from services.launcher import report
from services.launcher.deadletters import DeadLetterTally
from tests.fakes import make_item

KEYS = Keys("len")


class DeadLetterStream:
    """A dead-letter stream that answers XREAD as Redis does (entries after the given id,
    at most ``count``)."""

    def __init__(self) -> None:
        self.entries: list[tuple[bytes, dict[bytes, bytes]]] = []

    def add(self, source: str, reason: str, detail: str = "") -> None:
        fields = {b"source_stream": source.encode(), b"reason": reason.encode()}
        self.entries.append(
            (f"{len(self.entries) + 1}-0".encode(), fields | {b"detail": detail.encode()})
        )

    def xread(self, streams: dict[str, str], count: int) -> list[Any]:
        ((key, last),) = streams.items()
        assert key == KEYS.deadletter
        after = [e for e in self.entries if int(e[0].split(b"-")[0]) > int(last.split("-")[0])]
        return [[key.encode(), after[:count]]] if after else []


def learner_details() -> tuple[str, str]:
    """What the learner writes for an item longer than max_seq_len (1 prompt + 40 reply
    tokens against 32) and for one with token ids outside a 10-token vocabulary."""
    too_long = untrainable(make_item(1, 40), max_seq_len=32, vocab_size=None)
    vocab = untrainable(make_item(2, 2), max_seq_len=32, vocab_size=10)
    assert too_long is not None and vocab is not None
    return too_long, vocab


def test_the_learners_dead_letters_are_counted_by_reason_too_long_apart() -> None:
    too_long, vocab = learner_details()
    s = DeadLetterStream()
    s.add(KEYS.saw, "unusable_item", too_long)
    s.add(KEYS.saw, "unusable_item", vocab)
    s.add(KEYS.requests, "episode_error", "ValueError: cannot load problem 3")  # an actor's
    s.add(KEYS.saw, "max_deliveries", "delivered 3 times")
    tally = DeadLetterTally(KEYS)
    tally.update(s, batch=2)  # two reads of 2 entries, a third finds none
    assert tally.by_reason == {"unusable_item": 2, "max_deliveries": 1}
    assert (tally.unusable, tally.too_long, tally.last_id) == (2, 1, "4-0")
    s.add(KEYS.saw, "unusable_item", too_long)
    tally.update(s, batch=2)  # only what came since the last look
    assert (tally.unusable, tally.too_long) == (3, 2)


def tallied() -> DeadLetterTally:
    too_long, vocab = learner_details()
    tally = DeadLetterTally(KEYS)
    for detail in (too_long, too_long, vocab):
        tally.add(
            {
                b"source_stream": KEYS.saw.encode(),
                b"reason": b"unusable_item",
                b"detail": detail.encode(),
            }
        )
    return tally


def test_the_summary_counts_unusable_and_too_long_items() -> None:
    run = SimpleNamespace(
        s=SimpleNamespace(eval_n=0, eval_mode="live", actors=1),
        run_id="len",
        t0=0.0,
        last_learner={"ludic_learner_stale_dropped_total": 4.0},
        evals=[],
        curve=[],
        deadletters=tallied(),
    )
    s = report.build_summary(run, None, None, ok=True)
    assert (s["stale_dropped"], s["unusable_items"], s["too_long_items"]) == (4, 3, 2)
    assert s["learner_deadletters"] == {"unusable_item": 3}
    del run.deadletters  # a run that counted none (a fake, a failure before Redis)
    s = report.build_summary(run, None, None, ok=True)
    assert (s["unusable_items"], s["too_long_items"], s["learner_deadletters"]) == (0, 0, {})
