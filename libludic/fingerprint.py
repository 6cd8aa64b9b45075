"""What an item's credit was computed by, as one short string: ``credit_fingerprint``.

The credit worker and the learner build the run's algorithm each from the same ``algorithm:``
section; an item written under one definition of credit and trained under another (a learner
restarted with a changed config beside a credit worker that was not) would train on weights
the learner's algorithm would not have given it. Every item carries the fingerprint of the
algorithm that credited it (``SAWItem.credited_by``, one field of the wire body) and the
learner compares it with its own, once, when the item is admitted.

The fingerprint covers what decides an item's weight: the name, the credit assigner, the
reward shaping, the group preprocess (dynamic sampling) and the no-EOS mask, described by
:func:`describe` (dataclass fields and plain values; a function by its qualified name),
hashed: ``"<name>:<12 hex digits>"``. The loss is left out: it is the learner's alone, and a
learner restarted with another clip range still trains the items it reads. So is every
field named ``group_size`` (:data:`PER_REQUEST`): a group's size is its request's (the credit
worker builds one algorithm per size it meets), not the algorithm's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any

FINGERPRINT_HEX = 12
#: dataclass fields left out of a description: each request's own, not the algorithm's
PER_REQUEST = frozenset({"group_size"})


def describe(obj: Any) -> Any:
    """A JSON-able description of ``obj`` that is the same in every process that builds it
    from the same config (no addresses): plain values as they are, dataclasses as their
    type and fields (but :data:`PER_REQUEST`), functions and classes by qualified name, partials with their
    arguments, sequences and mappings element by element; anything else by its type."""
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {
            f.name: describe(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.name not in PER_REQUEST
        }
        return {"type": _qualname(type(obj)), "fields": fields}
    if isinstance(obj, functools.partial):
        return {
            "partial": describe(obj.func),
            "args": [describe(a) for a in obj.args],
            "kwargs": {k: describe(v) for k, v in sorted(obj.keywords.items())},
        }
    if isinstance(obj, list | tuple):
        return [describe(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): describe(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if callable(obj) and hasattr(obj, "__qualname__"):
        return _qualname(obj)
    return {"type": _qualname(type(obj))}


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def fingerprint(name: str, parts: dict[str, Any]) -> str:
    """``"<name>:<hash>"`` of ``parts`` described by :func:`describe`."""
    text = json.dumps(describe(parts), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_HEX]
    return f"{name}:{digest}"


def fingerprint_problem(value: Any) -> str | None:
    """Why ``value`` is not a fingerprint as :func:`fingerprint` writes it (None: it is)."""
    if not isinstance(value, str):
        return f"credited_by={value!r} is not a string"
    name, sep, digest = value.rpartition(":")
    if not (sep and name and len(digest) == FINGERPRINT_HEX) or any(
        c not in "0123456789abcdef" for c in digest
    ):
        return f"credited_by={value!r} is not '<algorithm>:<{FINGERPRINT_HEX} hex digits>'"
    return None
