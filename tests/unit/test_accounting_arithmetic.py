"""The accounting arithmetic (libludic/transport/accounting.py ``compute``) and its Prometheus export."""

from __future__ import annotations

from prometheus_client import REGISTRY

from libludic.transport import accounting
from services.learner import metrics as M

OBS = {"requests_backlog": 3, "rolling": 2, "open": 1, "saw_backlog": 4}


def counters(**kw: int) -> dict:
    base = dict(
        groups_requested=20,
        groups_trained=9,
        groups_dropped_stale=2,
        groups_dropped_incomplete=1,
        groups_dropped_empty=1,
        groups_deadlettered=1,
        items_written=30,
        items_trained=20,
        items_stale=4,
        items_deadlettered=2,
    )
    base.update(kw)
    return base


def test_in_flight_is_requested_minus_the_rest_and_matches_the_observation() -> None:
    a = accounting.compute(counters(), OBS)
    # 20 - (9 + 2 + 1 + 1 + 1) = 6 = 3 queued requests + 2 groups in rollouts + 1 open group
    assert a["groups_in_flight"] == 6 and a["groups_in_flight_observed"] == 6
    assert a["groups_dropped"] == 4  # 2 stale + 1 incomplete + 1 empty
    # 30 written - 20 trained - 4 stale - 2 dead-lettered = 4 = XLEN saw
    assert a["items_in_flight"] == 4 and a["consistent"]
    assert a["items_trained_twice"] == 0  # missing counters read as 0


def test_a_lost_or_double_counted_group_is_inconsistent() -> None:
    assert not accounting.compute(counters(groups_trained=10), OBS)["consistent"]
    assert not accounting.compute(counters(), {**OBS, "open": 0})["consistent"]
    assert not accounting.compute(counters(items_trained=21), OBS)["consistent"]


def test_export_sets_the_gauges() -> None:
    M.export_accounting(accounting.compute(counters(items_trained_twice=1), OBS))
    g = REGISTRY.get_sample_value
    assert g("ludic_run_groups_requested_total") == 20
    assert g("ludic_run_groups_trained_total") == 9
    assert g("ludic_run_groups_dropped_stale_total") == 2
    assert g("ludic_run_groups_deadlettered_total") == 1
    assert g("ludic_run_groups_in_flight") == 6
    assert g("ludic_run_accounting_consistent") == 1
    assert g("ludic_learner_items_trained_twice_total") == 1
    assert g("ludic_run_items_deadlettered_total") == 2  # the counters' items_deadlettered


def test_items_per_group_is_measured_with_a_floor_and_a_prior():
    from libludic.transport.accounting import items_per_group

    assert items_per_group(0, 0, group_size=8) == 8.0  # nothing credited yet: one per episode
    assert items_per_group(120, 3, group_size=8) == 40.0  # 8 games of 5 moves a group
    assert items_per_group(1, 4, group_size=8) == 1.0  # dynamic sampling dropped most: floor 1


def test_admission_rounds_a_part_group_up_so_a_synchronous_batch_completes():
    """Synchronous RL (max_head_offpolicyness 0) on tic-tac-toe: the learner lacked 7 items
    of its batch, a group was 25/3 items; rounding down admitted 0 groups forever (the
    learner waited at step 1 until the run's timeout). Rounded up: 1 group, at most one
    more than the room holds."""
    from libludic.transport.accounting import groups_for_room

    assert groups_for_room(7, 25 / 3) == 1
    assert groups_for_room(16, 8.0) == 2  # whole groups: unchanged
    assert groups_for_room(17, 8.0) == 3
    assert groups_for_room(0, 8.0) == 0 and groups_for_room(-5, 8.0) == 0
