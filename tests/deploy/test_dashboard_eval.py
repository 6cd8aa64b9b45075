"""The dashboard's evaluation panels: every eval figure the eval service exports has a panel
(by set and role), and KNOWN_METRICS' eval names are ones the eval service defines."""

from __future__ import annotations

import json

from deploy_support import KNOWN_METRICS, ROOT


def exported() -> set[str]:
    """The metric names registered in this process (counters with _total)."""
    from prometheus_client import REGISTRY

    import services.eval.worker  # noqa: F401  (registers the eval service's)

    return {f.name + "_total" if f.type == "counter" else f.name for f in REGISTRY.collect()}


def test_the_known_eval_metrics_are_the_eval_services_own() -> None:
    mine = {m for m in KNOWN_METRICS if m.startswith("ludic_eval_")}
    assert "ludic_eval_set_pass_rate" in mine and "ludic_eval_pass_rate" in mine
    assert mine <= exported(), mine - exported()


def test_every_eval_figure_has_a_panel_by_set_and_role() -> None:
    import services.eval.worker as ev

    board = json.loads((ROOT / "deploy/grafana/dashboards/ludic.json").read_text())
    panels = [
        p
        for p in board["panels"]
        if any("ludic_eval_set_" in t["expr"] for t in p.get("targets", []))
    ]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    families = {g.describe()[0].name for g in (*ev.SET_GAUGES.values(), ev.TRUNCATED)}
    shown = {f for f in families if f in exprs}
    assert shown == families - {"ludic_eval_set_episodes"}, families - shown
    assert ev.SET_DURATION.describe()[0].name in exprs
    for p in panels:
        for t in p["targets"]:
            if "role" in t["expr"]:
                assert "{{set}} {{role}}" in t["legendFormat"], p["title"]
    (row,) = [p for p in board["panels"] if p["type"] == "row" and p["title"] == "Evaluation"]
    assert all(p["gridPos"]["y"] == row["gridPos"]["y"] + 1 for p in panels)
