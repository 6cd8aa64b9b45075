"""What the ranks of a sharded Trainer agree on, each a collective every rank calls (gloo on
the CPU, NCCL on GPUs; ``device`` is where the reduced tensor lives): sums of batch-level
figures, a flag any rank raised, and the number of micro-batches every rank runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from libludic.saw import SAWItem
from libludic.training.minibatch import split_largest


def all_sum(xs: list[float], device: torch.device) -> list[float]:
    """``xs`` summed over every rank (batch-level statistics of a sharded batch)."""
    t = torch.tensor(xs, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(x) for x in t.cpu()]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank once ``flag`` is true on one (all-reduce MAX); ``flag`` itself
    without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def as_many_as_every_rank(
    micros: list[list[SAWItem]], device: torch.device, max_seq_len: int | None
) -> list[list[SAWItem]]:
    """``micros`` made as many as the most any rank packed. Under FSDP2 each micro-batch's
    forward and backward are collectives (the layers' all-gathers, the reduce-scatter after
    the last one), so ranks with different counts would pair one rank's gathers with
    another's next collective and hang. A rank with fewer splits its largest micro-batches;
    one with too few items for that adds inert micro-batches: a copy of one of its items
    with no action token and weight 0, whose forward and backward take part in the
    collectives and add nothing to the loss, its normalisers or any stat."""
    t = torch.tensor([len(micros)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    n = int(t.item())
    out = split_largest(micros, n, max_seq_len)
    while len(out) < n:
        it = out[0][0]
        inert = dataclasses.replace(
            it,
            action_mask=[0] * len(it.action_mask),
            weight=0.0,
            meta={**it.meta, "item_id": f"{it.meta.get('item_id')}#inert{len(out)}"},
        )
        out.append([inert])
    return out


def weight_stats(items: Sequence[SAWItem], device: torch.device | None) -> dict[str, float]:
    """The step's ``adv_mean`` and ``adv_std``: mean and population std of the items'
    ``weight`` (the credit each carries: the advantage for the group-relative presets),
    one value per item, over every rank's items when ``device`` is given (the sums are
    all-reduced there; None: this process's items only):

        adv_mean = sum_i w_i / n,   adv_std = sqrt(sum_i w_i^2 / n - adv_mean^2)

    (0 for one item; both 0 without items). Batch-level, so not loss stats: a std of
    micro-batch stds is not the batch's."""
    ws = [float(it.weight) for it in items]
    sums = [float(len(ws)), math.fsum(ws), math.fsum(w * w for w in ws)]
    if device is not None:
        sums = all_sum(sums, device)
    n, s1, s2 = sums
    if n <= 0:
        return {"adv_mean": 0.0, "adv_std": 0.0}
    mean = s1 / n
    return {"adv_mean": mean, "adv_std": math.sqrt(max(s2 / n - mean * mean, 0.0))}
