"""Which CPU cores each process of `ludic up` may run on (``up.cpu_pinning``).

On a machine without a GPU the learner trains on CPU cores that generation also wants: vLLM
binds its worker to cores of its own choosing (all but one, by its "auto" rule) and the
API server, EngineCore, actors, credit, feeder and Redis go wherever the kernel puts them.
Every few milliseconds one of them wakes on the learner's core, and the learner's step,
which is one long chain of small tensor ops, waits behind it (DEVELOPERS.md has the
figures, ``bench/step_profile.py`` measures them).

``auto`` (the default) therefore gives the learner ``learner_nproc * learner_threads`` cores
of its own (the last of the cores ``ludic up`` may use) and every other service the rest,
when no CUDA device is visible and at least one core is left for the others; ``off`` leaves
placement to the kernel. A pinned process's children inherit its cores (vLLM's worker then
binds its threads among them, torchrun's ranks share the learner's).

With one learner rank, the learner may also get the other cores for a second training
thread at idle priority (``spare_cores``, ``up.spare_core_training``; by default in
synchronous runs): the kernel runs it only when generation leaves those cores idle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PINNING_MODES = frozenset({"auto", "off"})


@dataclass(frozen=True)
class CpuPlan:
    learner: tuple[int, ...]
    others: tuple[int, ...]

    def for_service(self, name: str) -> tuple[int, ...]:
        return self.learner if name == "learner" else self.others


def plan_cpus(
    mode: str, learner_cores: int, available: list[int], gpu: bool
) -> tuple[CpuPlan | None, str]:
    """The plan (None: no pinning) and one line saying why, for the launcher's log."""
    if mode not in PINNING_MODES:
        raise ValueError(f"up.cpu_pinning={mode!r}; use one of {sorted(PINNING_MODES)}")
    if learner_cores < 1:
        raise ValueError(f"the learner needs at least one core, got {learner_cores}")
    if mode == "off":
        return None, "cpu pinning off (up.cpu_pinning: off)"
    if gpu:
        return None, "cpu pinning off: a CUDA device is visible (the learner trains there)"
    cores = sorted(available)
    if len(cores) - learner_cores < 1:
        return None, (
            f"cpu pinning off: the learner's {learner_cores} core(s) would leave none of "
            f"the {len(cores)} usable for generation"
        )
    plan = CpuPlan(learner=tuple(cores[-learner_cores:]), others=tuple(cores[:-learner_cores]))
    return plan, (
        f"cpu pinning: learner on cores {_ranges(plan.learner)}, every other service on "
        f"{_ranges(plan.others)} (up.cpu_pinning: off to let the kernel place them)"
    )


def spare_cores(
    plan: CpuPlan | None,
    learner_nproc: int,
    enabled: bool | None,
    configured: tuple[int, ...],
    synchronous: bool,
) -> tuple[int, ...]:
    """The cores the learner's second training thread may use at idle priority
    (libludic/training/spare_core.py): the generation cores, when the learner is pinned apart
    from them and runs one rank, and ``up.spare_core_training`` is true, or unset and the
    run is synchronous (``max_head_offpolicyness`` 0: generation idles while the learner
    trains, so those cores are free; in an asynchronous run generation keeps them busy and
    the thread gains nothing; DEVELOPERS.md has the figures). None when the learner's own settings give ``spare_cores``
    (``configured``, from its run config section or environment: used as it is)."""
    on = synchronous if enabled is None else enabled
    if not on or plan is None or learner_nproc != 1 or configured:
        return ()
    return plan.others


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity mask: a container's cpuset)."""
    return sorted(os.sched_getaffinity(0))


def cuda_visible() -> bool:
    import torch  # for this question only: the CPU plan itself is plain data

    return bool(torch.cuda.is_available())


def _ranges(cores: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    out: list[str] = []
    start = prev = cores[0]
    for c in cores[1:] + (None,):  # type: ignore[operator]
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)
