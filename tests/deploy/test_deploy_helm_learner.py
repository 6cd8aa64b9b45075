"""helm/ludic's learner as one torchrun job over one or more pods (``learner.nodes``), as a
StatefulSet or as a LeaderWorkerSet group: the rendered command, environment, ports, Service
and NetworkPolicy, validated offline like the rest of the chart (test_deploy_helm.py)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from deploy_support import (
    K8S_VERSIONS,
    Doc,
    by_kind,
    containers,
    find,
    parse_docs,
    render,
    rendered,
)

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed"
)

NAME = "rl-ludic-learner"  # <release>-<chart>-learner
SVC_DNS = f"{NAME}.ludic.svc.cluster.local"
TAIL = ["-m", "services.cli", "learner"]


def learner(docs: list[Doc]) -> Doc:
    return containers(find(docs, "StatefulSet", "learner"))[0]


def learner_service(docs: list[Doc]) -> Doc:
    (svc,) = [
        d
        for d in by_kind(docs, "Service")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "learner"
    ]
    return svc


def peers(policy: Doc) -> list[str | None]:
    return [
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
        for r in policy["spec"]["ingress"]
        for p in r["from"]
    ]


def validate(doc: Doc) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_one_node_is_torchrun_standalone_in_one_pod():
    docs = rendered("default")
    sts = find(docs, "StatefulSet", "learner")
    c = learner(docs)
    assert c["command"] == ["torchrun"]
    assert c["args"] == ["--standalone", "--nproc_per_node=1", *TAIL]
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["podManagementPolicy"] == "OrderedReady"
    assert [p["name"] for p in c["ports"]] == ["metrics"]
    assert "publishNotReadyAddresses" not in learner_service(docs)["spec"]
    assert "learner" not in peers(find(docs, "NetworkPolicy", "learner"))


def test_nodes_make_one_torchrun_job_joined_at_pod_0():
    """ci/learner-nodes-values.yaml: 2 pods x 4 GPUs. Every pod runs the same command: c10d
    rendezvous at pod 0's DNS name on the headless Service (its name resolves before any pod
    is ready), the run id as the rendezvous id, the pod's own DNS name as its node address."""
    docs = rendered("learner-nodes")
    sts = find(docs, "StatefulSet", "learner")
    c = learner(docs)
    assert c["args"] == [
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={NAME}-0.{SVC_DNS}:29400",
        "--rdzv_id=rl",
        f"--local_addr=$(POD_NAME).{SVC_DNS}",
        *TAIL,
    ]
    assert sts["spec"]["replicas"] == 2
    # the pods rendezvous before any is ready: OrderedReady would wait for pod 0 forever
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # per pod: 4 ranks
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert {"name": "rdzv", "containerPort": 29400, "protocol": "TCP"} in c["ports"]
    svc = learner_service(docs)
    assert svc["metadata"]["name"] == sts["spec"]["serviceName"] == NAME
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    # the pods reach each other (rendezvous, NCCL/gloo on dynamic ports)
    policy = find(docs, "NetworkPolicy", "learner")
    (rule,) = [
        r for r in policy["spec"]["ingress"] if "learner" in peers({"spec": {"ingress": [r]}})
    ]
    assert "ports" not in rule
    validate({k: v for k, v in sts.items() if k != "_template"})


@pytest.mark.parametrize("nodes", [2, 3, 10, 11, 64])
def test_pod_0_sorts_first_so_it_hosts_global_rank_0(nodes):
    """Under c10d torchrun numbers the nodes in the sorted order of their addresses (it
    ignores --node_rank): with every pod's DNS name as its address, pod 0's comes first for
    any number of pods, so rank 0 (and the checkpoints on pod 0's volume) stays on pod 0."""
    docs = parse_docs(render({"learner": {"nodes": nodes}}))
    arg = next(a for a in learner(docs)["args"] if a.startswith("--local_addr="))
    addrs = [
        arg.removeprefix("--local_addr=").replace("$(POD_NAME)", f"{NAME}-{i}")
        for i in range(nodes)
    ]
    assert sorted(addrs)[0] == addrs[0]
    endpoint = next(a for a in learner(docs)["args"] if a.startswith("--rdzv_endpoint="))
    assert endpoint == f"--rdzv_endpoint={addrs[0]}:29400"


def test_rdzv_port_and_run_id_follow_values():
    docs = parse_docs(render({"runId": "exp7", "learner": {"nodes": 2, "rdzvPort": 29500}}))
    args = learner(docs)["args"]
    assert f"--rdzv_endpoint={NAME}-0.{SVC_DNS}:29500" in args and "--rdzv_id=exp7" in args
    assert {"name": "rdzv", "containerPort": 29500, "protocol": "TCP"} in learner(docs)["ports"]


LWS = {
    "learner": {
        "nodes": 2,
        "leaderWorkerSet": {"enabled": True},
        "persistence": {"existingClaim": "ludic-checkpoints"},
    }
}


def test_leader_worker_set_runs_the_job_as_one_group():
    docs = parse_docs(render(LWS))
    assert not by_kind(docs, "StatefulSet") or all(
        d["metadata"]["labels"]["app.kubernetes.io/component"] != "learner"
        for d in by_kind(docs, "StatefulSet")
    )
    (lws,) = by_kind(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 1
    tmpl = spec["leaderWorkerTemplate"]
    assert tmpl["size"] == 2
    # one pod lost breaks every rank's collectives: the group restarts together
    assert tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    pod = tmpl["workerTemplate"]  # leader and workers alike
    (c,) = pod["spec"]["containers"]
    assert c["args"] == [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=$(LWS_LEADER_ADDRESS):29400",
        "--rdzv_id=rl",
        *TAIL,
    ]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "ludic-checkpoints"
    # the operator names its own headless Service after the set: the metrics one differs
    svc = learner_service(docs)
    assert svc["metadata"]["name"] == f"{NAME}-metrics"
    assert all(pod["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
    # no offline schema for the custom resource: its pod template is checked as a core one
    validate(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": NAME}, "template": pod}
    )


def test_leader_worker_set_without_a_shared_claim_fails_with_the_fix():
    values = copy.deepcopy(LWS)
    del values["learner"]["persistence"]
    with pytest.raises(
        helm_python.HelmError, match=re.escape("set learner.persistence.existingClaim")
    ):
        render(values)
    values["learner"]["persistence"] = {"enabled": False}
    assert by_kind(parse_docs(render(values)), "LeaderWorkerSet")


@pytest.mark.parametrize(
    "values,message",
    [
        ({"learner": {"nodes": 0}}, "minimum"),
        ({"learner": {"rdzvPort": 70000}}, "maximum"),
        ({"learner": {"leaderWorkerSet": {"enabled": True, "size": 2}}}, "size"),
    ],
)
def test_schema_rejects_bad_node_values(values: dict[str, Any], message: str):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
        render(values)
