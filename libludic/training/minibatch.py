"""How one step's items are cut up: into PPO minibatches, into enough micro-batches for the
spare-core thread, and how the minibatches' stats combine (used by the Trainer)."""

from __future__ import annotations

from collections.abc import Sequence

from libludic.saw import SAWItem
from libludic.training.collate import effective_len
from libludic.training.loss import is_max_stat


def split_minibatches(items: Sequence[SAWItem], n: int) -> list[list[SAWItem]]:
    """``items`` in ``n`` contiguous parts (1 <= n <= len(items)) whose sizes differ by at
    most one, the larger first: 10 items, n=4 -> 3, 3, 2, 2."""
    if not 1 <= n <= len(items):
        raise ValueError(f"cannot split {len(items)} items into {n} minibatches")
    k, r = divmod(len(items), n)
    out: list[list[SAWItem]] = []
    i = 0
    for j in range(n):
        size = k + (1 if j < r else 0)
        out.append(list(items[i : i + size]))
        i += size
    return out


def split_largest(
    micros: list[list[SAWItem]], n: int, max_seq_len: int | None = None
) -> list[list[SAWItem]]:
    """``micros`` with its largest micro-batch (padded tokens) cut in two, again and again,
    until there are ``n`` (or every one holds a single item)."""
    out = [list(m) for m in micros]
    while len(out) < n:
        cost = [len(m) * max(effective_len(it, max_seq_len) for it in m) for m in out]
        j = max((k for k in range(len(out)) if len(out[k]) > 1), key=cost.__getitem__, default=-1)
        if j < 0:
            break
        m = out[j]
        out[j : j + 1] = [m[: len(m) // 2], m[len(m) // 2 :]]
    return out


def combine_minibatch_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """One step's stats from its minibatches' (see ``Trainer._update``): ``loss``,
    ``grad_norm``, ``critic_grad_norm`` and ``spare_core_share`` are means over the
    minibatches; a loss stat
    (``loss/<key>``) is the token-weighted mean, or the max for a ``_max`` key (the rule of
    ``loss.is_max_stat``, as over micro-batches); every other key (counts, times) a sum."""
    toks = [max(p.get("num_action_tokens", 0.0), 0.0) for p in parts]
    total = sum(toks) or 1.0
    out: dict[str, float] = {"num_minibatches": float(len(parts))}
    for key in parts[0]:
        vals = [p.get(key, 0.0) for p in parts]
        if key in ("loss", "grad_norm", "critic_grad_norm", "spare_core_share"):
            out[key] = sum(vals) / len(vals)
        elif key.startswith("loss/") and is_max_stat(key):
            out[key] = max(vals)
        elif key.startswith("loss/"):
            out[key] = sum(t * v for t, v in zip(toks, vals)) / total
        else:
            out[key] = sum(vals)
    return out
