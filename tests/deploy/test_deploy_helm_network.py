"""The chart's NetworkPolicies, rendered offline for every scenario: who may reach each
component (ingress) and what each may reach (egress: default deny but for its peers).
Enforcement needs a CNI that enforces policies (docs/deployment.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from deploy_support import (
    SCENARIOS,
    Doc,
    find,
    parse_docs,
    render,
    rendered,
    scenario_values,
    selects,
)

pytest.importorskip("helm_python", reason="helm-python-sdk not installed")

ALL = ["default", *SCENARIOS]


def policy_for(docs: list[Doc], component: str) -> Doc:
    return find(docs, "NetworkPolicy", component)


@pytest.mark.parametrize("scenario", ALL)
def test_network_policies_guard_inference_and_redis(scenario):
    docs = rendered(scenario)
    values = scenario_values(scenario)
    guarded = ["inference", "learner"] + (
        ["redis"] if values.get("redis", {}).get("enabled", True) else []
    )
    for comp in guarded:
        np = policy_for(docs, comp)
        kind = "StatefulSet" if comp in ("learner", "redis") else "Deployment"
        pod_labels = find(docs, kind, comp)["spec"]["template"]["metadata"]["labels"]
        assert selects(np["spec"]["podSelector"]["matchLabels"], pod_labels), comp
        assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
        for rule in np["spec"]["ingress"]:
            # an ingress rule without `from` admits every pod in the cluster
            assert rule.get("from"), f"{comp}: rule open to everyone: {rule}"
    inference_np = policy_for(docs, "inference")
    peers = [
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
        for r in inference_np["spec"]["ingress"]
        for p in r["from"]
    ]
    assert {"actor", "eval", "learner"} <= set(peers)
    assert "credit" not in peers and "feeder" not in peers  # they never call inference
    if "redis" in guarded:
        (rule,) = policy_for(docs, "redis")["spec"]["ingress"]
        expr = rule["from"][0]["podSelector"]["matchExpressions"][0]
        assert sorted(expr["values"]) == ["actor", "credit", "eval", "feeder", "learner"]
        assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


def egress_peers(np: Doc) -> dict[str, list[Any]]:
    """A policy's egress, by peer: the component a rule's podSelector names, "dns" for the
    cluster DNS, "any" for a rule without `to`, else the peers as rendered; -> its ports."""
    out: dict[str, list[Any]] = {}
    for rule in np["spec"]["egress"]:
        ports = [p["port"] for p in rule.get("ports", [])] or ["*"]
        for peer in rule.get("to") or [None]:
            if peer is None:
                name = "any"
            elif peer.get("podSelector", {}).get("matchLabels", {}).get("k8s-app") == "kube-dns":
                name = "dns"
            else:
                labels = peer.get("podSelector", {}).get("matchLabels", {})
                name = labels.get("app.kubernetes.io/component") or json.dumps(peer)
            out.setdefault(name, []).extend(ports)
    return out


@pytest.mark.parametrize("scenario", ALL)
def test_every_component_is_denied_all_but_what_it_talks_to(scenario):
    """Default deny, ingress and egress, for every component's pods; egress only to the
    cluster DNS and the peers it uses (the actors, which run untrusted code in their
    sandbox: DNS, Redis and the inference API only)."""
    docs = rendered(scenario)
    bundled = scenario_values(scenario).get("redis", {}).get("enabled", True)
    redis = {"redis": ["redis"]} if bundled else {"any": [6380]}  # ci: rediss://...:6380/2
    dns = {"dns": [53, 53]}
    want = {
        "actor": {**dns, **redis, "inference": ["http"]},
        "eval": {**dns, **redis, "inference": ["http"]},
        "credit": {**dns, **redis},
        "feeder": {**dns, **redis},
        "learner": {**dns, **redis, "inference": ["*"]},
        "inference": {**dns, "learner": ["*"]},
    }
    if scenario == "learner-nodes":  # the pods of its torchrun job reach each other
        want["learner"]["learner"] = ["*"]
    for comp, peers in want.items():
        np = policy_for(docs, comp)
        kind = "StatefulSet" if comp == "learner" else "Deployment"
        pod_labels = find(docs, kind, comp)["spec"]["template"]["metadata"]["labels"]
        assert selects(np["spec"]["podSelector"]["matchLabels"], pod_labels), comp
        assert np["spec"]["policyTypes"] == ["Ingress", "Egress"], comp
        assert egress_peers(np) == peers, comp
        for rule in np["spec"].get("ingress", []):
            assert rule.get("from"), f"{comp}: ingress rule open to everyone: {rule}"
    if bundled:
        assert policy_for(docs, "redis")["spec"]["egress"] == []


def test_egress_can_be_narrowed_and_extended():
    values = {
        **scenario_values("external-redis"),
        "networkPolicy": {
            "externalRedis": {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}]},
            "actor": {"extraEgress": [{"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}]},
        },
    }
    docs = parse_docs(render(values))
    actor = egress_peers(policy_for(docs, "actor"))
    assert actor[json.dumps({"ipBlock": {"cidr": "10.1.2.3/32"}})] == [6380]
    assert actor[json.dumps({"ipBlock": {"cidr": "10.9.0.0/16"}})] == ["*"]
    assert "any" not in actor
    assert "any" not in egress_peers(policy_for(docs, "credit"))


def test_eval_disabled_renders_no_eval_objects_or_peers():
    docs = parse_docs(render({"eval": {"enabled": False}, **scenario_values("gpu")}))
    components = {d["metadata"]["labels"].get("app.kubernetes.io/component") for d in docs}
    assert "eval" not in components
    inference_peers = [
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
        for r in policy_for(docs, "inference")["spec"]["ingress"]
        for p in r["from"]
    ]
    assert "eval" not in inference_peers
    (rule,) = policy_for(docs, "redis")["spec"]["ingress"]
    assert "eval" not in rule["from"][0]["podSelector"]["matchExpressions"][0]["values"]


def test_scrapers_reach_metrics_ports_only_when_selected():
    docs = rendered("gpu")
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    for comp, port in (("inference", "metrics"), ("learner", "metrics")):
        rules = policy_for(docs, comp)["spec"]["ingress"]
        scrape = [r for r in rules if {"namespaceSelector": monitoring} in r["from"]]
        assert scrape and scrape[0]["ports"] == [{"port": port, "protocol": "TCP"}], comp
    for rule in policy_for(rendered("cpu-minimal"), "inference")["spec"]["ingress"]:
        assert all("namespaceSelector" not in peer for peer in rule["from"])
