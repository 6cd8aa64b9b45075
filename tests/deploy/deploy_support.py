"""Shared helpers for the offline deployment checks (no Docker engine, no cluster).

The chart is rendered by Helm's own Go engine (helm-python-sdk: libhelm_c over the Helm SDK),
so template errors, `fail` calls and values.schema.json are enforced exactly as `helm install`
would; rendered objects are then validated with kubernetes-validate against a pinned
Kubernetes OpenAPI schema.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "ludic"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
SCENARIOS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]
RELEASE, NAMESPACE = "rl", "ludic"
# Kubernetes versions the rendered manifests are validated against: the chart's kubeVersion
# floor (Chart.yaml ">=1.29.0-0") and a current release.
K8S_VERSIONS = ("1.29.0", "1.33.0")
# Custom resources: kubernetes-validate ships only the core API schemas.
CRD_KINDS = {"ServiceMonitor", "ScaledObject", "TriggerAuthentication"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
# Metric names the services export; dashboards and rules may use nothing else.
KNOWN_METRICS = {
    "ludic_learner_step",
    "ludic_learner_loss",
    "ludic_learner_samples_per_second",
    "ludic_learner_tokens_per_second",
    "ludic_learner_stale_dropped_total",
    "ludic_learner_publish_seconds_bucket",
    "ludic_learner_publish_seconds_sum",
    "ludic_learner_publish_seconds_count",
    "ludic_learner_replica_acked_version",
    "ludic_learner_policy_version",
    "ludic_learner_train_signal",
    "ludic_learner_grad_norm",
    "ludic_learner_lr",
    "ludic_learner_nonfinite_steps_skipped_total",
    "ludic_learner_batch_wait_fraction",
    "ludic_actor_episodes_total",
    "ludic_actor_reward_bucket",
    "ludic_actor_reward_sum",
    "ludic_actor_reward_count",
    "ludic_credit_items_total",
    "ludic_credit_deadlettered_total",
    "ludic_credit_groups_total",
    "ludic_stream_length",
    "ludic_inference_policy_version",
    "ludic_inference_weight_updates_total",
    "ludic_inference_requests_total",
    "ludic_eval_pass_rate",
    "ludic_eval_reward_mean",
    "ludic_eval_step",
    "ludic_eval_policy_version",
    "ludic_eval_duration_seconds",
    "ludic_eval_runs_total",
    "ludic_eval_errors_total",
    "ludic_eval_set_pass_rate",
    "ludic_eval_set_pass_at_k",
    "ludic_eval_set_mean_at_k",
    "ludic_eval_set_reward_mean",
    "ludic_eval_set_episode_len_mean",
    "ludic_eval_set_parse_error_rate",
    "ludic_eval_set_illegal_rate",
    "ludic_eval_set_truncated_rate",
    "ludic_eval_set_episodes",
    "ludic_eval_set_duration_seconds",
}

Doc = dict[str, Any]


def scenario_values(scenario: str) -> dict[str, Any]:
    if scenario == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / f"{scenario}-values.yaml").read_text()) or {}


@functools.cache
def _chart():
    helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")
    return helm_python.Chart.load(str(CHART))


def render(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text (raises helm_python.HelmError on failure)."""
    return _chart().render(values, name=RELEASE, namespace=NAMESPACE)


def parse_docs(rendered: dict[str, str]) -> list[Doc]:
    docs: list[Doc] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".txt"):  # NOTES.txt
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["_template"] = (
                    path  # where it came from, for messages (dropped before validation)
                )
                docs.append(doc)
    return docs


@functools.cache
def _rendered_json(scenario: str) -> str:
    return json.dumps(parse_docs(render(scenario_values(scenario))))


def rendered(scenario: str) -> list[Doc]:
    """Parsed documents of one scenario (a fresh copy; tests may mutate it)."""
    return json.loads(_rendered_json(scenario))


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def find(docs: list[Doc], kind: str, component: str) -> Doc:
    for d in docs:
        labels = d["metadata"].get("labels") or {}
        if d.get("kind") == kind and labels.get("app.kubernetes.io/component") == component:
            return d
    raise AssertionError(f"no {kind} for component {component!r} in the rendered chart")


def containers(workload: Doc) -> list[Doc]:
    return workload["spec"]["template"]["spec"]["containers"]


def scrape_ports() -> dict[str, int]:
    """service -> the port Prometheus scrapes in compose and the chart: the table's port, or
    the one its cell names as "`/metrics` on N" (inference: /metrics apart from its API)."""
    text = (ROOT / "DEVELOPERS.md").read_text()
    out = {name: port for name, (port, _) in developers_table().items()}
    for line in text.splitlines():
        m = re.match(r"^\|\s*(inference|actor|credit|learner|feeder)\s*\|.*?\|([^|]*)\|", line)
        if m and (apart := re.search(r"`/metrics` on (\d+)", m.group(2))):
            out[m.group(1)] = int(apart.group(1))
    return out


def developers_table() -> dict[str, tuple[int, list[str]]]:
    """service -> (health port, LUDIC_* variables it reads), from DEVELOPERS.md's table."""
    text = (ROOT / "DEVELOPERS.md").read_text()
    table: dict[str, tuple[int, list[str]]] = {}
    for line in text.splitlines():
        m = re.match(
            r"^\|\s*(inference|actor|credit|learner|feeder)\s*\|.*?\|\s*(\d+)[^|]*\|([^|]*)\|", line
        )
        if m:
            table[m.group(1)] = (int(m.group(2)), re.findall(r"LUDIC_[A-Z_]+", m.group(3)))
    assert set(table) == {"inference", "actor", "credit", "learner", "feeder"}, (
        f"could not read the services table from DEVELOPERS.md (got {sorted(table)})"
    )
    return table


def promtool() -> str:
    exe = shutil.which("promtool")
    if not exe:
        pytest.skip(
            "promtool not found on PATH: install Debian's `prometheus` package "
            "(make system-deps) to run the Prometheus config/rules checks"
        )
    return exe


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
