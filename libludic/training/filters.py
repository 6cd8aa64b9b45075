"""Sample filters: keep-predicates over SAWItems, plus rollout-level preprocessors.

``SampleFilter = Callable[[SAWItem], bool]`` returns True to **keep** an item. Filters run
*after* credit assignment (on ``SAWItem.meta``: truncated, finish_reason, parse_error), so
dropping a sample never changes the group statistics of the samples that stay. Each
``drop_*`` is a factory (call it) so filters can take options and compose with
``combine(...)``::

    sample_filter = combine(drop_truncated(), drop_incomplete_completions())

Rollout-level preprocessing that must see whole groups (``drop_zero_variance_groups``)
has the ``PreprocessFn`` shape ``Callable[[List[Rollout]], List[Rollout]]`` and runs
*before* credit assignment (``RLAlgorithm.preprocess``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from libludic.saw import SAWItem
from libludic.types import Rollout

SampleFilter = Callable[[SAWItem], bool]
PreprocessFn = Callable[[list[Rollout]], list[Rollout]]


def drop_truncated() -> SampleFilter:
    """Drop items whose step was truncated (episode cut by max_steps or the env)."""

    def keep(item: SAWItem) -> bool:
        return not bool(item.meta.get("truncated", False))

    return keep


def drop_incomplete_completions() -> SampleFilter:
    """Drop items whose completion hit max_tokens (finish_reason == "length")."""

    def keep(item: SAWItem) -> bool:
        return item.meta.get("finish_reason") != "length"

    return keep


def drop_parse_errors() -> SampleFilter:
    """Drop items whose action failed the protocol's parser (meta["parse_error"] truthy)."""

    def keep(item: SAWItem) -> bool:
        return not item.meta.get("parse_error")

    return keep


def combine(*filters: SampleFilter) -> SampleFilter:
    """Keep an item only if every filter keeps it (no filters: keep everything)."""
    fs = tuple(filters)

    def keep(item: SAWItem) -> bool:
        return all(f(item) for f in fs)

    return keep


def apply_filter(items: Sequence[SAWItem], sample_filter: SampleFilter | None) -> list[SAWItem]:
    return list(items) if sample_filter is None else [it for it in items if sample_filter(it)]


def drop_zero_variance_groups(rollouts: list[Rollout]) -> list[Rollout]:
    """Drop every group whose rollouts all have the same total reward: dynamic sampling
    (the presets' ``dynamic_sampling``; DAPO, AReaL; ScaleRL's zero-variance filter).

    Such a group has zero advantage everywhere under group-centred credit, so it only
    dilutes the batch. Rollouts without a group_id are kept; a group of one rollout has no
    variance and is dropped.
    """
    groups: OrderedDict[str, list[Rollout]] = OrderedDict()
    for r in rollouts:
        if r.group_id is not None:
            groups.setdefault(r.group_id, []).append(r)
    zero_var = {gid for gid, rs in groups.items() if len({r.total_reward for r in rs}) <= 1}
    return [r for r in rollouts if r.group_id is None or r.group_id not in zero_var]
