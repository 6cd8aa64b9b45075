"""Context strategies from plain data: a kind, or ``{kind, kwargs}``.

A kind is a registered name (entry-point group ``ludic.contexts``: ``full``,
``truncated_thinking``) or an import path ``pkg.mod:Class`` naming a ContextStrategy,
built with the kwargs: ``{kind: truncated_thinking, kwargs: {max_thinking_chars: 200}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libludic import plugins
from libludic.context.base import ContextStrategy
from libludic.plugins import PluginError

#: a protocol's ``context``: a kind, or ``{kind, kwargs}`` with the strategy's keyword arguments
ContextSpec = str | Mapping[str, Any]


def make_context(
    kind: ContextSpec = "full", where: str = "context", **kwargs: Any
) -> ContextStrategy:
    """The context strategy ``kind`` (or ``{kind, kwargs}``) built with its keyword arguments;
    an unknown kind or keyword lists the known ones."""
    if isinstance(kind, Mapping):
        unknown = sorted(set(kind) - {"kind", "kwargs"})
        if unknown:
            raise PluginError(f"{where}: unknown key(s) {unknown}; known: kind, kwargs")
        kwargs = {**dict(kind.get("kwargs") or {}), **kwargs}
        kind = kind.get("kind", "full")
    ctx = plugins.build("contexts", kind, kwargs, where=f"{where}.kind")
    if not isinstance(ctx, ContextStrategy):
        raise PluginError(
            f"{where}.kind={kind!r} built a {type(ctx).__name__}, not a ContextStrategy "
            "(libludic/context/base.py)"
        )
    return ctx
