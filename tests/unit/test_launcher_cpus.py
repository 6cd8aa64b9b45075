"""``up.cpu_pinning``: how the launcher splits the cores between the learner and the rest."""

from __future__ import annotations

import pytest

from services.launcher.cpus import CpuPlan, plan_cpus, spare_cores
from services.launcher.settings import UpSettings


def test_auto_gives_the_learner_the_last_cores_and_the_others_the_rest() -> None:
    plan, why = plan_cpus("auto", 1, [0, 1], gpu=False)
    assert plan == CpuPlan(learner=(1,), others=(0,))
    assert plan.for_service("learner") == (1,)
    assert plan.for_service("inference") == plan.for_service("actor-3") == (0,)
    assert "learner on cores 1, every other service on 0" in why
    # a container's cpuset need not start at 0 nor be contiguous
    plan, why = plan_cpus("auto", 2, [9, 2, 3, 4, 7, 8], gpu=False)
    assert plan == CpuPlan(learner=(8, 9), others=(2, 3, 4, 7))
    assert "cores 8-9, every other service on 2-4,7" in why


@pytest.mark.parametrize(
    ("mode", "learner", "cores", "gpu", "reason"),
    [
        ("off", 1, [0, 1], False, "up.cpu_pinning: off"),
        ("auto", 1, [0, 1], True, "a CUDA device is visible"),
        ("auto", 2, [0, 1], False, "would leave none of the 2 usable"),
        ("auto", 1, [0], False, "would leave none of the 1 usable"),
    ],
)
def test_no_plan_where_pinning_cannot_help(mode, learner, cores, gpu, reason) -> None:
    plan, why = plan_cpus(mode, learner, cores, gpu)
    assert plan is None
    assert reason in why


def test_a_bad_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="up.cpu_pinning='always'"):
        UpSettings(cpu_pinning="always")
    with pytest.raises(ValueError, match="up.cpu_pinning='always'"):
        plan_cpus("always", 1, [0, 1], gpu=False)


PLAN = CpuPlan(learner=(1,), others=(0,))


@pytest.mark.parametrize(
    "plan, nproc, enabled, configured, sync, want",
    [
        (PLAN, 1, None, (), True, (0,)),  # default: on for synchronous RL
        (PLAN, 1, None, (), False, ()),  # ... off for asynchronous
        (PLAN, 1, True, (), False, (0,)),
        (None, 1, True, (), True, ()),  # not pinned: no cores are the generation's alone
        (PLAN, 2, True, (), True, ()),  # FSDP2 ranks
        (PLAN, 1, False, (), True, ()),  # up.spare_core_training: false
        (PLAN, 1, True, (1,), True, ()),  # the learner's own spare_cores setting
    ],
)
def test_the_learner_gets_the_generation_cores_as_spare_ones_only_when_pinned_alone(
    plan, nproc, enabled, configured, sync, want
) -> None:
    assert spare_cores(plan, nproc, enabled, configured, synchronous=sync) == want
