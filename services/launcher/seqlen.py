"""The start-up check of item lengths: every feeder task against ``learner.max_seq_len``.

For each task of the run config (libludic/seqlen.py has the estimate and its formula): the
first prompts of the feeder's first env seeds, counted with the run's tokenizer (``up.model``'s,
or the tiny byte-level model's that ``ludic up`` builds when ``up.model`` is empty; a byte
bound where neither loads), the task's sampling ``max_tokens`` and the calls an episode of
``actor.max_steps`` steps may make. ``ludic up`` refuses a run in which one model call cannot
fit (exit 2, before it starts anything) and logs a warning for an episode that may not;
``ludic check`` prints the same lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libludic.seqlen import (
    SEEDS,
    ChatTokens,
    SeqLenEstimate,
    estimate,
    load_chat_tokens,
    task_shape,
    verdict,
)
from libludic.tasks import TaskSpec
from services.launcher.resolved import Resolved
from services.launcher.settings import UpSettings


@dataclass(frozen=True)
class LengthLine:
    """One task's outcome: its figures, or why it may not fit (``warn``)."""

    text: str
    warn: bool = False

    def __str__(self) -> str:
        return self.text


def fits(est: SeqLenEstimate) -> str:
    """The line of a task that fits: its figures and what counted them."""
    episode = f", episode of {est.calls} calls at least {est.episode}" if est.calls > 1 else ""
    return (
        f"{est.where}: one call up to {est.one_call} tokens ({est.prompt_tokens} prompt, the "
        f"longest of {est.prompts}, + {est.max_tokens} max_tokens){episode}; fits "
        f"learner.max_seq_len (counted with {est.counted_with})"
    )


def check_lengths(
    tasks: Sequence[TaskSpec],
    max_seq_len: int,
    max_steps: int,
    tokens: ChatTokens,
    seed_base: int = 0,
    seeds: int = SEEDS,
) -> list[LengthLine]:
    """Every task of ``tasks`` (the feeder's parsed TaskSpecs) against ``max_seq_len``, from
    env seeds ``seed_base .. seed_base + seeds - 1`` (the feeder's first). Raises ValueError
    naming the task, the numbers and the settings to change when one call cannot fit. A
    task none of whose seeds made a model call (its env fails on each) is a warning: the
    run reports a failing task with its reason (services/launcher/deadletters.py)."""
    out = []
    for i, task in enumerate(tasks):
        shape = task_shape(task, range(seed_base, seed_base + seeds), f"feeder.tasks[{i}]")
        try:
            est = estimate(shape, tokens, max_steps)
        except ValueError as e:  # no prompt to count
            out.append(LengthLine(f"{e}; not checked", warn=True))
            continue
        warning = verdict(est, max_seq_len)
        out.append(LengthLine(fits(est)) if warning is None else LengthLine(warning, warn=True))
    return out


def check_run(up: UpSettings, resolved: Resolved, max_steps: int) -> list[LengthLine]:
    """:func:`check_lengths` of the run: the feeder's tasks and seeds, the learner's
    ``max_seq_len``, the actors' ``max_steps`` and the run's tokenizer."""
    return check_lengths(
        resolved.feeder.parsed_tasks,
        resolved.learner.max_seq_len,
        max_steps,
        load_chat_tokens(up.model or None),
        resolved.feeder.seed_base,
    )
