"""The chart's least-privilege rules (issue: least privilege everywhere), rendered offline for
every scenario: who gets the generation token, and read-only roots with bounded scratch."""

from __future__ import annotations

import pytest
from deploy_support import SCENARIOS, WORKLOAD_KINDS, containers, rendered, scenario_values

pytest.importorskip("helm_python", reason="helm-python-sdk not installed")

ALL = ["default", *SCENARIOS]


@pytest.mark.parametrize("scenario", ALL)
def test_the_generation_token_reaches_inference_and_every_client_of_it(scenario):
    """inference requires LUDIC_API_KEY on its generation routes (from the auth Secret's
    api-key, or auth.existingSecretApiKeyKey); actors and eval send it; nothing else gets it."""
    docs = rendered(scenario)
    values = scenario_values(scenario)
    key = values.get("auth", {}).get("existingSecretApiKeyKey", "api-key")
    got = set()
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS:
            for c in containers(d):
                for env in c.get("env", []):
                    if env["name"] == "LUDIC_API_KEY":
                        assert env["valueFrom"]["secretKeyRef"]["key"] == key
                        got.add(d["metadata"]["labels"]["app.kubernetes.io/component"])
    want = {"inference", "actor"} | (
        {"eval"} if values.get("eval", {}).get("enabled", True) else set()
    )
    assert got == want, (scenario, got)


@pytest.mark.parametrize("scenario", ALL)
def test_every_ludic_container_has_a_read_only_root_with_bounded_scratch(scenario):
    """readOnlyRootFilesystem on every container and init container of every workload, with
    /tmp and the home directory writable from emptyDirs that have a sizeLimit (the compose
    file gives the same containers the same layout: tests/containers runs it)."""
    docs = rendered(scenario)
    seen = set()
    for d in docs:
        if d["kind"] not in WORKLOAD_KINDS:
            continue
        pod = d["spec"]["template"]["spec"] if "template" in d["spec"] else None
        if pod is None:  # LeaderWorkerSet: its leader and worker templates
            tmpl = d["spec"]["leaderWorkerTemplate"]
            pods = [t["spec"] for k, t in tmpl.items() if k.endswith("Template")]
        else:
            pods = [pod]
        for p in pods:
            empty = {v["name"]: v["emptyDir"] for v in p.get("volumes", []) if "emptyDir" in v}
            for c in p["containers"] + p.get("initContainers", []):
                seen.add(c["name"])
                assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                for path in ("/tmp", "/home/ludic"):
                    if c["name"] == "redis":
                        continue
                    assert path in mounts, (c["name"], path)
                    assert empty[mounts[path]].get("sizeLimit"), (c["name"], path)
    assert {"inference", "actor", "credit", "learner", "feeder"} <= seen, seen


BOUNDED_DISK = {"actor", "credit", "feeder", "eval"}  # no emptyDir of theirs holds a model


@pytest.mark.parametrize("scenario", ALL)
def test_every_service_container_has_cpu_and_memory_limits(scenario):
    """A runaway service (a sandboxed tool in an actor, a loop in credit) is throttled and
    bounded instead of starving its node: CPU and memory limits on every service container,
    ephemeral-storage on those whose emptyDirs hold no model, checkpoints or AOF."""
    seen = set()
    for d in rendered(scenario):
        if d["kind"] not in WORKLOAD_KINDS:
            continue
        comp = d["metadata"]["labels"]["app.kubernetes.io/component"]
        for c in containers(d):
            limits = c.get("resources", {}).get("limits", {})
            assert {"cpu", "memory"} <= set(limits), (scenario, comp, c["name"], limits)
            if comp in BOUNDED_DISK:
                requests = c["resources"].get("requests", {})
                assert "ephemeral-storage" in limits and "ephemeral-storage" in requests, comp
            seen.add(comp)
    assert {"inference", "learner", "actor", "credit", "feeder"} <= seen


def _pod_checksums(values) -> dict[str, str]:
    from deploy_support import parse_docs, render

    out = {}
    for d in parse_docs(render(values)):
        if d["kind"] in WORKLOAD_KINDS and "template" in d["spec"]:
            ann = d["spec"]["template"]["metadata"].get("annotations", {})
            out[d["metadata"]["labels"]["app.kubernetes.io/component"]] = ann.get(
                "checksum/secrets"
            )
    return out


def test_a_new_or_rotated_secret_rolls_the_pods_that_read_it():
    """Every pod carries checksum/secrets over the secrets' inputs (not their generated
    values, which lookup keeps across upgrades): a token or password given in values, or a
    bumped rotation after an existingSecret was rotated, changes it; rendering the same
    values twice does not (no random value in it)."""
    base = _pod_checksums({})
    assert base == _pod_checksums({})
    assert all(base.values()) and {"inference", "actor", "learner", "redis"} <= set(base)
    token = _pod_checksums({"auth": {"token": "t" * 32}})
    assert all(token[c] != base[c] for c in ("inference", "actor", "learner"))
    rotated = _pod_checksums({"redis": {"auth": {"rotation": "2026-12-06"}}})
    assert all(rotated[c] != base[c] for c in base), rotated
