"""deploy/prometheus: `promtool check config`, `check rules` and `test rules` (Debian's
prometheus package; skipped with a reason when promtool is absent)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from deploy_support import KNOWN_METRICS, ROOT, promtool

PROM = ROOT / "deploy" / "prometheus"
REQUIRED_ALERTS = {
    "LudicLearnerStalled",
    "LudicStaleDropRateHigh",
    "LudicWeightPublishFailing",
    "LudicDeadLetterGrowing",
}


def run(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_check_config():
    res = run("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_config_rejects_a_broken_config(tmp_path):
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "fast"
    cfg["rule_files"] = []
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    assert run("check", "config", "prometheus.yml", cwd=tmp_path).returncode != 0


def test_promtool_check_rules():
    res = run("check", "rules", "rules.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_rules_rejects_a_broken_expression(tmp_path):
    rules = yaml.safe_load((PROM / "rules.yml").read_text())
    rules["groups"][1]["rules"][0]["expr"] = "changes(ludic_learner_step[15m] == 0"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    assert run("check", "rules", "rules.yml", cwd=tmp_path).returncode != 0


def test_promtool_test_rules():
    res = run("test", "rules", "rules_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_test_rules_fails_when_an_alert_is_weakened(tmp_path):
    """The unit tests bite: raising a threshold past the test data makes them fail."""
    shutil.copy(PROM / "rules_test.yml", tmp_path)
    text = (
        (PROM / "rules.yml")
        .read_text()
        .replace(
            "sum(increase(ludic_credit_deadlettered_total[15m])) > 5",
            "sum(increase(ludic_credit_deadlettered_total[15m])) > 500",
        )
    )
    (tmp_path / "rules.yml").write_text(text)
    assert run("test", "rules", "rules_test.yml", cwd=tmp_path).returncode != 0


def test_required_alerts_exist_and_are_tested():
    rules = yaml.safe_load((PROM / "rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert REQUIRED_ALERTS <= alerts
    tests = (PROM / "rules_test.yml").read_text()
    for alert in alerts:
        assert f"alertname: {alert}" in tests, f"{alert} has no promtool test"
    for r in (r for g in rules["groups"] for r in g["rules"] if "alert" in r):
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_rules_use_only_exported_metrics():
    text = "\n".join(
        r["expr"]
        for g in yaml.safe_load((PROM / "rules.yml").read_text())["groups"]
        for r in g["rules"]
    )
    used = set(re.findall(r"\bludic_[a-z_]+\b", text))
    assert used and used <= KNOWN_METRICS, used - KNOWN_METRICS


def test_prometheus_loads_the_rules_file():
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["rules.yml"]
