"""helm/ludic: rendered with Helm's Go engine for every ci/ scenario, linted, validated.

What runs offline here: template rendering + `fail` guards + values.schema.json (Helm engine),
`helm lint --strict`, and kubernetes-validate (strict, pinned versions) on every core object.
Custom resources (ServiceMonitor, ScaledObject, TriggerAuthentication) have no schema offline:
they are checked structurally below. Scheduling, GPUs, PVC binding, NetworkPolicy enforcement
and KEDA/prometheus-operator behaviour need a real cluster.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import pytest
import yaml
from deploy_support import (
    CHART,
    CRD_KINDS,
    K8S_VERSIONS,
    NAMESPACE,
    ROOT,
    SCENARIOS,
    WORKLOAD_KINDS,
    Doc,
    by_kind,
    containers,
    developers_table,
    find,
    parse_docs,
    render,
    rendered,
    scenario_values,
    selects,
)

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed"
)

ALL = ["default", *SCENARIOS]
SECRET_ENV = {"LUDIC_AUTH_TOKEN", "LUDIC_API_KEY", "REDIS_PASSWORD", "REDISCLI_AUTH"}


def test_every_issue_scenario_has_a_ci_values_file():
    assert set(SCENARIOS) >= {"cpu-minimal", "gpu", "external-redis", "keda"}


# ---------------------------------------------------------------- lint + schema validation


@pytest.mark.parametrize("scenario", ALL)
def test_helm_lint_strict_is_clean(scenario):
    report = helm_python.lint(
        str(CHART),
        scenario_values(scenario),
        strict=True,
        namespace=NAMESPACE,
        kube_version="v1.33.0",
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, json.dumps(report, indent=1)


def k8s_errors(doc: Doc, version: str) -> list[str]:
    """kubernetes-validate (strict: unknown fields are errors) -> list of messages."""
    doc = {k: v for k, v in doc.items() if k != "_template"}
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [
            f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}"
        ]
    return []


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("scenario", ALL)
def test_rendered_objects_match_kubernetes_schema(scenario, version):
    docs = [d for d in rendered(scenario) if d["kind"] not in CRD_KINDS]
    assert docs
    errors = [e for d in docs for e in k8s_errors(d, version)]
    assert not errors, "\n".join(errors)


def test_kubernetes_validate_rejects_a_broken_object():
    """The validator is live: an unknown field and a wrong type are both reported."""
    dep = copy.deepcopy(find(rendered("cpu-minimal"), "Deployment", "actor"))
    dep["spec"]["replicas"] = "three"
    assert k8s_errors(dep, K8S_VERSIONS[-1])
    dep = copy.deepcopy(find(rendered("cpu-minimal"), "Deployment", "actor"))
    containers(dep)[0]["livenessProbes"] = {}  # typo'd field: strict mode must reject it
    assert k8s_errors(dep, K8S_VERSIONS[-1])


def test_only_known_custom_resources_skip_schema_validation():
    kinds = {d["kind"] for s in ALL for d in rendered(s)}
    unknown = set()
    for kind in kinds - CRD_KINDS:
        doc = next(d for s in ALL for d in rendered(s) if d["kind"] == kind)
        try:
            kubernetes_validate.validate(
                {k: v for k, v in doc.items() if k != "_template"}, K8S_VERSIONS[-1], strict=True
            )
        except kubernetes_validate.SchemaNotFoundError:
            unknown.add(kind)
    assert not unknown, (
        f"kinds without an offline schema that are not checked structurally: {unknown}"
    )


# ---------------------------------------------------------------- custom resources (structural)


def crd_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    deployments = {d["metadata"]["name"] for d in by_kind(docs, "Deployment")}
    for sm in by_kind(docs, "ServiceMonitor"):
        spec = sm.get("spec", {})
        if sm.get("apiVersion") != "monitoring.coreos.com/v1":
            problems.append(
                f"ServiceMonitor {sm['metadata']['name']}: apiVersion {sm.get('apiVersion')}"
            )
        if not spec.get("selector", {}).get("matchLabels"):
            problems.append(f"ServiceMonitor {sm['metadata']['name']}: no selector.matchLabels")
        for ep in spec.get("endpoints") or [{}]:
            if not isinstance(ep.get("port"), str):
                problems.append(
                    f"ServiceMonitor {sm['metadata']['name']}: endpoint without a port name"
                )
            if not re.fullmatch(r"\d+(ms|s|m|h)", str(ep.get("interval", "30s"))):
                problems.append(
                    f"ServiceMonitor {sm['metadata']['name']}: bad interval {ep.get('interval')}"
                )
    for so in by_kind(docs, "ScaledObject"):
        spec = so.get("spec", {})
        name = so["metadata"]["name"]
        if so.get("apiVersion") != "keda.sh/v1alpha1":
            problems.append(f"ScaledObject {name}: apiVersion {so.get('apiVersion')}")
        if spec.get("scaleTargetRef", {}).get("name") not in deployments:
            problems.append(f"ScaledObject {name}: scaleTargetRef is not a rendered Deployment")
        if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
            problems.append(f"ScaledObject {name}: minReplicaCount > maxReplicaCount")
        for trig in spec.get("triggers") or []:
            meta = trig.get("metadata", {})
            if trig.get("type") != "prometheus":
                problems.append(f"ScaledObject {name}: trigger type {trig.get('type')}")
            # KEDA trigger metadata is map[string]string
            if not all(isinstance(v, str) for v in meta.values()):
                problems.append(f"ScaledObject {name}: non-string trigger metadata {meta}")
            if not {"serverAddress", "query", "threshold"} <= set(meta):
                problems.append(
                    f"ScaledObject {name}: prometheus trigger lacks serverAddress/query/threshold"
                )
            # demand, never a stream the feeder holds at its admission limit
            if "ludic_learner_batch_wait_fraction" not in meta.get("query", ""):
                problems.append(
                    f"ScaledObject {name}: query {meta.get('query')!r} is not the "
                    "learner's wait for items"
                )
            if trig.get("metricType") != "Value":
                problems.append(
                    f"ScaledObject {name}: metricType {trig.get('metricType')}: use "
                    "Value (aim the wait share at the target)"
                )
            try:
                if not 0 < float(meta.get("threshold", "x")) <= 1:
                    raise ValueError
            except ValueError:
                problems.append(
                    f"ScaledObject {name}: threshold {meta.get('threshold')!r} is "
                    "not a wait share in (0, 1]"
                )
    for ta in by_kind(docs, "TriggerAuthentication"):
        for ref in ta.get("spec", {}).get("secretTargetRef") or []:
            if not {"parameter", "name", "key"} <= set(ref):
                problems.append(
                    f"TriggerAuthentication {ta['metadata']['name']}: incomplete secretTargetRef"
                )
    return problems


@pytest.mark.parametrize("scenario", ALL)
def test_custom_resources_are_structurally_sound(scenario):
    assert not crd_problems(rendered(scenario))


def test_keda_scenario_scales_actors_on_the_learners_wait_for_items():
    docs = rendered("keda")
    (so,) = by_kind(docs, "ScaledObject")
    (trig,) = so["spec"]["triggers"]
    meta = trig["metadata"]
    # the learner's moving-average wait share, aimed at 0.1 (ci/keda-values.yaml): more actors
    # while it starves, fewer once it stops waiting (the gauge: tests/unit/test_learner_metrics.py)
    assert trig["type"] == "prometheus" and trig["metricType"] == "Value"
    assert meta["query"] == f'max(ludic_learner_batch_wait_fraction{{namespace="{NAMESPACE}"}})'
    assert meta["threshold"] == "0.1"
    assert meta["serverAddress"] == "http://prometheus-operated.monitoring:9090"
    assert (
        so["spec"]["scaleTargetRef"]["name"]
        == find(docs, "Deployment", "actor")["metadata"]["name"]
    )
    # the autoscaler owns the replica count
    assert "replicas" not in find(docs, "Deployment", "actor")["spec"]
    assert not by_kind(docs, "HorizontalPodAutoscaler")


def test_structural_crd_check_catches_mistakes():
    docs = rendered("keda")
    so = by_kind(docs, "ScaledObject")[0]
    so["spec"]["scaleTargetRef"]["name"] = "nope"
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 0.1
    assert len(crd_problems(docs)) == 2


def test_structural_crd_check_rejects_a_supply_trigger():
    docs = rendered("keda")
    trig = by_kind(docs, "ScaledObject")[0]["spec"]["triggers"][0]
    trig["metadata"]["query"] = "redis_stream_length"
    name = by_kind(docs, "ScaledObject")[0]["metadata"]["name"]
    assert crd_problems(docs) == [
        f"ScaledObject {name}: query 'redis_stream_length' is not the learner's wait for items"
    ]


# ---------------------------------------------------------------- GPUs, replicas


def gpu_limit(container: Doc) -> Any:
    return ((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")


def test_gpu_scenario_requests_gpus_for_inference_and_learner():
    docs = rendered("gpu")
    values = scenario_values("gpu")
    inference = find(docs, "Deployment", "inference")
    learner = find(docs, "StatefulSet", "learner")
    assert gpu_limit(containers(inference)[0]) == values["inference"]["gpus"] == 1
    assert gpu_limit(containers(learner)[0]) == values["learner"]["gpus"] == 4
    # torchrun starts one rank per GPU of the node
    args = containers(learner)[0]["args"]
    assert containers(learner)[0]["command"] == ["torchrun"]
    assert "--nproc_per_node=4" in args
    assert args[-3:] == ["-m", "services.cli", "learner"]
    # nothing else asks for a GPU
    others = [
        c["name"]
        for d in docs
        if d["kind"] in WORKLOAD_KINDS
        for c in containers(d)
        if gpu_limit(c) and c["name"] not in ("inference", "learner")
    ]
    assert not others


def test_cpu_scenario_requests_no_gpu_and_runs_cpu_ranks():
    docs = rendered("cpu-minimal")
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS:
            for c in containers(d):
                assert gpu_limit(c) is None, f"{d['metadata']['name']}/{c['name']} asks for a GPU"
    learner = containers(find(docs, "StatefulSet", "learner"))[0]
    assert "--nproc_per_node=2" in learner["args"]


@pytest.mark.parametrize("scenario", ["cpu-minimal", "gpu", "external-redis"])
def test_actor_replicas_come_from_values(scenario):
    expected = scenario_values(scenario)["actor"]["replicaCount"]
    assert find(rendered(scenario), "Deployment", "actor")["spec"]["replicas"] == expected


def test_actor_replicas_are_independent_of_other_components():
    docs = parse_docs(render({"actor": {"replicaCount": 11}, "inference": {"replicaCount": 3}}))
    assert find(docs, "Deployment", "actor")["spec"]["replicas"] == 11
    assert find(docs, "Deployment", "inference")["spec"]["replicas"] == 3
    assert find(docs, "Deployment", "credit")["spec"]["replicas"] == 1


def test_hpa_owns_actor_replicas_when_enabled():
    docs = parse_docs(
        render({"actor": {"autoscaling": {"hpa": {"enabled": True, "maxReplicas": 9}}}})
    )
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["maxReplicas"] == 9
    assert (
        hpa["spec"]["scaleTargetRef"]["name"]
        == find(docs, "Deployment", "actor")["metadata"]["name"]
    )
    assert "replicas" not in find(docs, "Deployment", "actor")["spec"]
    assert not k8s_errors(hpa, K8S_VERSIONS[-1])


# ---------------------------------------------------------------- secrets


def secret_literals(values: dict[str, Any]) -> list[str]:
    out = [
        values.get("auth", {}).get("token", ""),
        values.get("auth", {}).get("apiKey", ""),
        values.get("externalRedis", {}).get("password", ""),
    ]
    return [s for s in out if s]


def secret_leaks(docs: list[Doc], literals: list[str]) -> list[str]:
    """Secret values outside Secret objects, and secret env vars not taken from a Secret."""
    leaks: list[str] = []
    needles = literals + [base64.b64encode(s.encode()).decode() for s in literals]
    for d in docs:
        if d["kind"] == "Secret":
            continue
        text = json.dumps(d)
        leaks += [
            f"{d['kind']}/{d['metadata']['name']} contains a secret value"
            for n in needles
            if n in text
        ]
        if d["kind"] not in WORKLOAD_KINDS:
            continue
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            for env in c.get("env", []):
                where = f"{d['metadata']['name']}/{c['name']} env {env['name']}"
                if env["name"] in SECRET_ENV and "secretKeyRef" not in env.get("valueFrom", {}):
                    leaks.append(f"{where} is not a secretKeyRef")
                # the Redis URL is a mounted file (tests/deploy/test_deploy_redis_users.py)
                if env["name"] == "LUDIC_REDIS_URL" or re.search(
                    r"://[^/\s]*@", env.get("value", "")
                ):
                    leaks.append(f"{where} carries credentials")
    return leaks


@pytest.mark.parametrize("scenario", ALL)
def test_secrets_are_never_inline(scenario):
    docs = rendered(scenario)
    assert not secret_leaks(docs, secret_literals(scenario_values(scenario)))


@pytest.mark.parametrize("scenario", ALL)
def test_secret_refs_point_at_rendered_or_existing_secrets(scenario):
    docs = rendered(scenario)
    values = scenario_values(scenario)
    known = {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    known |= {values.get(k, {}).get("existingSecret") for k in ("auth", "externalRedis")}
    known |= {values.get("redis", {}).get("auth", {}).get("existingSecret")}
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS:
            for c in containers(d):
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] in known, (
                            f"{c['name']}: {env['name']} -> unknown Secret {ref['name']}"
                        )
            for vol in d["spec"]["template"]["spec"].get("volumes", []):
                if "secret" in vol:
                    name = vol["secret"]["secretName"]
                    assert name in known, (
                        f"{d['metadata']['name']}: volume -> unknown Secret {name}"
                    )


def test_inline_secret_values_land_only_in_secret_objects():
    docs = rendered("cpu-minimal")
    token = scenario_values("cpu-minimal")["auth"]["token"]
    (auth,) = [d for d in by_kind(docs, "Secret") if "auth-token" in d.get("data", {})]
    assert base64.b64decode(auth["data"]["auth-token"]).decode() == token


def test_gpu_scenario_creates_no_secret_when_existing_ones_are_given():
    assert not by_kind(rendered("gpu"), "Secret")


def test_secret_leak_check_catches_an_inline_token():
    docs = rendered("cpu-minimal")
    token = scenario_values("cpu-minimal")["auth"]["token"]
    inference = find(docs, "Deployment", "inference")
    containers(inference)[0]["env"][0] = {"name": "LUDIC_AUTH_TOKEN", "value": token}
    leaks = secret_leaks(docs, [token])
    assert any("contains a secret value" in x for x in leaks)
    assert any("is not a secretKeyRef" in x for x in leaks)


# ---------------------------------------------------------------- probes, ports


def probe_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    for d in docs:
        if d["kind"] not in WORKLOAD_KINDS:
            continue
        for c in containers(d):  # init containers run to completion and take no probes
            ports = {p.get("name") for p in c.get("ports", [])}
            for kind in ("livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                if not probe:
                    problems.append(f"{d['metadata']['name']}/{c['name']}: no {kind}")
                    continue
                port = probe.get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    problems.append(
                        f"{d['metadata']['name']}/{c['name']}: {kind} port {port} not declared"
                    )
    return problems


@pytest.mark.parametrize("scenario", ALL)
def test_every_container_has_liveness_and_readiness_probes(scenario):
    assert not probe_problems(rendered(scenario))


def test_probe_check_catches_a_missing_probe():
    docs = rendered("cpu-minimal")
    del containers(find(docs, "Deployment", "credit"))[0]["readinessProbe"]
    assert probe_problems(docs) == ["rl-ludic-credit/credit: no readinessProbe"]


@pytest.mark.parametrize("scenario", ["cpu-minimal"])
def test_ports_and_commands_follow_developers_md(scenario):
    table = developers_table()
    docs = rendered(scenario)
    for service, (port, reads) in table.items():
        kind = "StatefulSet" if service == "learner" else "Deployment"
        c = containers(find(docs, kind, service))[0]
        assert port in {p["containerPort"] for p in c["ports"]}, service
        argv = c.get("command", []) + c["args"]
        assert service in argv, f"{service}: container does not run `ludic {service}`: {argv}"
        env = {e["name"] for e in c.get("env", [])}
        # the Redis URL is read from the file LUDIC_REDIS_URL_FILE names
        missing = set(reads) - env - {"LUDIC_MODEL_DIR", "LUDIC_MAX_LAG", "LUDIC_REDIS_URL"}
        assert not missing, f"{service} lacks {missing}"
    inference = containers(find(docs, "Deployment", "inference"))[0]
    assert inference["args"][:2] == ["inference", "--model"]
    assert inference["args"][2].startswith("/models/")


# ---------------------------------------------------------------- ServiceMonitor


def servicemonitor_problems(docs: list[Doc]) -> list[str]:
    problems: list[str] = []
    services = by_kind(docs, "Service")
    workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    for sm in by_kind(docs, "ServiceMonitor"):
        name = sm["metadata"]["name"]
        matched = [
            s
            for s in services
            if s["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
            and selects(sm["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
        ]
        if not matched:
            problems.append(f"{name}: selects no Service")
        for svc in matched:
            port_names = {p["name"]: p for p in svc["spec"]["ports"]}
            pods = [
                w
                for w in workloads
                if selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
            ]
            pod_ports = {
                p.get("name") for w in pods for c in containers(w) for p in c.get("ports", [])
            }
            for ep in sm["spec"]["endpoints"]:
                if ep["port"] not in port_names:
                    problems.append(
                        f"{name}: port {ep['port']!r} not on Service {svc['metadata']['name']}"
                    )
                elif port_names[ep["port"]]["targetPort"] not in pod_ports:
                    problems.append(f"{name}: Service targetPort not a named container port")
    return problems


def test_servicemonitors_select_named_metrics_ports():
    docs = rendered("gpu")
    sms = by_kind(docs, "ServiceMonitor")
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in sms} == {
        "inference",
        "actor",
        "credit",
        "learner",
        "feeder",
        "eval",
    }
    assert all(d["metadata"]["labels"]["release"] == "kube-prometheus-stack" for d in sms)
    assert not servicemonitor_problems(docs)


def test_servicemonitor_check_catches_a_wrong_port_name():
    docs = rendered("gpu")
    by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] = "web"
    assert any("port 'web'" in p for p in servicemonitor_problems(docs))


@pytest.mark.parametrize("scenario", ALL)
def test_ludic_pods_carry_prometheus_annotations(scenario):
    for d in rendered(scenario):
        comp = d["metadata"]["labels"].get("app.kubernetes.io/component")
        if d["kind"] in WORKLOAD_KINDS and comp != "redis":
            ann = d["spec"]["template"]["metadata"]["annotations"]
            port = int(ann["prometheus.io/port"])
            assert ann["prometheus.io/scrape"] == "true"
            assert port in {p["containerPort"] for p in containers(d)[0]["ports"]}


# ---------------------------------------------------------------- PDB


def test_pod_disruption_budgets_cover_scaled_components():
    docs = rendered("gpu")
    covered = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in by_kind(docs, "PodDisruptionBudget")
    }
    assert {"inference", "actor", "learner"} <= covered


def test_learner_keeps_checkpoints_on_a_pvc():
    learner = find(rendered("gpu"), "StatefulSet", "learner")
    (claim,) = learner["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    mounts = {m["name"]: m["mountPath"] for m in containers(learner)[0]["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/checkpoints"


def test_bundled_redis_persists_with_aof():
    """(Its users: tests/deploy/test_deploy_redis_users.py.)"""
    redis = find(rendered("default"), "StatefulSet", "redis")
    (script,) = containers(redis)[0]["args"]
    args = script.split("exec redis-server", 1)[1].split()
    assert args[args.index("--appendonly") + 1] == "yes"
    # full Redis refuses writes rather than evicting stream entries
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert args[args.index("--maxmemory") + 1] == "3gb"
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


# ---------------------------------------------------------------- values.schema.json


BAD_VALUES = [
    ({"actor": {"replicaCount": -1}}, "minimum"),
    ({"actor": {"replicaCount": "three"}}, "want integer"),
    ({"inference": {"gpus": 1.5}}, "want integer"),
    ({"learner": {"replicaCount": 2}}, "maximum"),
    ({"actor": {"env": {"LUDIC_AUTH_TOKEN": "plain"}}}, "LUDIC_AUTH_TOKEN"),
    ({"redis": {"appendfsync": "sometimes"}}, "appendfsync"),
    ({"redis": {"maxmemory": "lots"}}, "maxmemory"),
    # one password for every service is gone: the Redis Secret has a user per role
    ({"redis": {"auth": {"password": "pw"}}}, "password"),
    ({"externalRedis": {"existingSecretPasswordKey": "pw"}}, "existingSecretPasswordKey"),
    ({"externalRedis": {"url": "redis://user:pw@redis:6379/0"}}, "does not match pattern"),
    ({"inference": {"image": {"digest": "latest"}}}, "does not match pattern"),
    ({"actor": {"replicaCoutn": 3}}, "replicaCoutn"),
    ({"typo": True}, "typo"),
    # the retired stream triggers fail at render instead of being silently ignored
    ({"actor": {"autoscaling": {"keda": {"lagCount": 16}}}}, "lagCount"),
    ({"actor": {"autoscaling": {"keda": {"consumerGroup": "actors"}}}}, "consumerGroup"),
    ({"actor": {"autoscaling": {"keda": {"streamLength": 16}}}}, "streamLength"),
    ({"actor": {"autoscaling": {"keda": {"learnerWaitTarget": "2"}}}}, "does not match pattern"),
    # LUDIC_RESUME is always on and needs checkpoints
    ({"learner": {"checkpointEvery": 0}}, "minimum"),
    ({"learner": {"numSteps": -1}}, "minimum"),
    ({"eval": {"ompNumThreads": 0}}, "minimum"),
    ({"eval": {"replicaCount": 2}}, "maximum"),
]


@pytest.mark.parametrize("values,message", BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_schema_rejects_bad_values_at_render(values, message):
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize("values,_", BAD_VALUES)
def test_schema_rejects_bad_values_with_jsonschema(values, _):
    """The same schema, read by Python's jsonschema: portable to other Helm versions."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    merged = _chart_merge(values)
    assert list(jsonschema.Draft7Validator(schema).iter_errors(merged))


def _chart_merge(values):
    base = yaml.safe_load((CHART / "values.yaml").read_text())

    def merge(a, b):
        for k, v in b.items():
            a[k] = (
                merge(a.get(k, {}), v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
            )
        return a

    return merge(base, copy.deepcopy(values))


@pytest.mark.parametrize("scenario", ALL)
def test_schema_accepts_defaults_and_ci_values(scenario):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = [
        e.message
        for e in jsonschema.Draft7Validator(schema).iter_errors(
            _chart_merge(scenario_values(scenario))
        )
    ]
    assert not errors


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"actor": {"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}}}},
            "not both",
        ),
        ({"redis": {"enabled": False}}, "externalRedis.url"),
        # an external Redis without AUTH is refused unless said so
        (
            {"redis": {"enabled": False}, "externalRedis": {"url": "redis://redis:6379/0"}},
            "externalRedis has no password",
        ),
        (
            {"redis": {"enabled": False}, "externalRedis": {"url": "http://redis:6379"}},
            "does not match pattern",
        ),
        # a checkpoint: mapping in the run config would win over the learner's env
        (
            {"config": {"checkpoint": {"every_n_steps": 5}}},
            "config.checkpoint: the chart sets the learner's checkpoint from values",
        ),
        ({"config": {"learner": {"num_steps": 100}}}, "set learner.numSteps"),
    ],
)
def test_template_guards_fail_with_a_fix(values, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values)


def test_every_value_is_documented_with_a_param_comment():
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"^\s*## @param (\S+)", text, flags=re.M))

    def leaves(node, prefix=""):
        for k, v in node.items():
            path = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                yield from leaves(v, path + ".")
            else:
                yield path

    undocumented = [
        p
        for p in leaves(yaml.safe_load(text))
        if not any(p == d or p.startswith(d + ".") for d in documented)
    ]
    assert not undocumented, undocumented


def test_each_component_block_has_the_same_shape():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    keys = {
        "image",
        "replicaCount",
        "resources",
        "env",
        "livenessProbe",
        "readinessProbe",
        "startupProbe",
        "nodeSelector",
        "tolerations",
        "affinity",
    }
    for comp in ("inference", "actor", "credit", "learner", "feeder", "eval", "redis"):
        assert keys <= set(values[comp]), f"{comp} misses {keys - set(values[comp])}"


def test_learner_env_follows_values():
    """The learner trains the model inference serves and checkpoints where its volume is."""
    values = {
        "inference": {"model": {"name": "Qwen2.5-0.5B-Instruct"}},
        "learner": {
            "checkpointEvery": 7,
            "numSteps": 300,
            "ompNumThreads": 4,
            "persistence": {"mountPath": "/ckpt"},
        },
    }
    docs = parse_docs(render(values))
    learner = containers(find(docs, "StatefulSet", "learner"))[0]
    env = {e["name"]: e.get("value") for e in learner["env"]}
    assert env["LUDIC_MODEL_DIR"] == "/models/Qwen2.5-0.5B-Instruct"
    assert (
        containers(find(docs, "Deployment", "inference"))[0]["args"][2]
        == "/models/Qwen2.5-0.5B-Instruct"
    )
    assert env["LUDIC_OUTPUT_DIR"] == "/ckpt"
    mounts = {m["name"]: m["mountPath"] for m in learner["volumeMounts"]}
    assert mounts["checkpoints"] == "/ckpt"
    assert (env["LUDIC_RESUME"], env["LUDIC_CHECKPOINT_EVERY"], env["LUDIC_NUM_STEPS"]) == (
        "true",
        "7",
        "300",
    )
    assert env["OMP_NUM_THREADS"] == "4"


def test_omp_threads_come_from_values_once():
    """ompNumThreads renders OMP_NUM_THREADS as compose.yaml sets it; <component>.env wins."""

    def omp(docs, kind, comp):
        env = containers(find(docs, kind, comp))[0]["env"]
        return [e["value"] for e in env if e["name"] == "OMP_NUM_THREADS"]

    docs = rendered("default")
    for kind, comp, threads in (
        ("Deployment", "actor", ["1"]),
        ("Deployment", "credit", ["1"]),
        ("Deployment", "eval", ["1"]),
        ("StatefulSet", "learner", ["2"]),
        ("Deployment", "feeder", []),
        ("Deployment", "inference", []),
    ):
        assert omp(docs, kind, comp) == threads, comp
    overridden = parse_docs(
        render({"actor": {"ompNumThreads": 3, "env": {"OMP_NUM_THREADS": "8"}}})
    )
    assert omp(overridden, "Deployment", "actor") == ["8"]


def test_every_service_mounts_the_run_config_it_is_pointed_at():
    docs = rendered("default")
    for kind, comp, var in (
        ("Deployment", "inference", "LUDIC_CONFIG"),
        ("Deployment", "actor", "LUDIC_CONFIG"),
        ("Deployment", "credit", "LUDIC_CONFIG"),
        ("StatefulSet", "learner", "LUDIC_CONFIG"),
        ("Deployment", "feeder", "LUDIC_CONFIG"),
        ("Deployment", "eval", "LUDIC_CONFIG"),
    ):
        workload = find(docs, kind, comp)
        c = containers(workload)[0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env[var] == "/etc/ludic/config.yaml", comp
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["config"] == "/etc/ludic", comp
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == "rl-ludic-config", comp
    assert "LUDIC_INFERENCE_CONFIG" not in str(docs)  # retired: inference would refuse to start
    (cm,) = by_kind(docs, "ConfigMap")
    assert "inference" in yaml.safe_load(cm["data"]["config.yaml"])  # its section, to fill in


def test_cpu_inference_sets_the_vllm_kv_cache_once():
    """gpus: 0 renders VLLM_CPU_KVCACHE_SPACE (as compose.yaml does); inference.env overrides it."""

    def kv_env(docs):
        env = containers(find(docs, "Deployment", "inference"))[0]["env"]
        return [e["value"] for e in env if e["name"] == "VLLM_CPU_KVCACHE_SPACE"]

    assert kv_env(rendered("default")) == []  # GPU inference
    assert kv_env(parse_docs(render({"inference": {"gpus": 0}}))) == ["1"]
    assert kv_env(parse_docs(render({"inference": {"gpus": 0, "cpuKVCacheSpaceGiB": 4}}))) == ["4"]
    # ci/cpu-minimal-values.yaml sets it through inference.env: once, not twice
    assert kv_env(rendered("cpu-minimal")) == ["1"]
    overridden = {"inference": {"gpus": 0, "env": {"VLLM_CPU_KVCACHE_SPACE": "2"}}}
    assert kv_env(parse_docs(render(overridden))) == ["2"]


# ---------------------------------------------------------------- a user's own package


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``helm -f a -f b``: maps merge key by key, anything else from ``b``."""
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_a_users_image_runs_every_component_that_builds_their_kinds():
    """examples/custom_env/deploy/helm-values.yaml over the CPU scenario (README "Bring your
    own environment"): feeder, actor, credit and eval run the user's image, inference and the
    learner the project's; every pod reads the user's run config; the objects are valid."""
    from libludic.tasks import check_task, parse_tasks

    user = yaml.safe_load((ROOT / "examples/custom_env/deploy/helm-values.yaml").read_text())
    docs = parse_docs(render(_merge(scenario_values("cpu-minimal"), user)))
    want = "ghcr.io/ludic/ludic-guess:0.1.0-cpu"
    for component in ("feeder", "actor", "credit", "eval"):
        (c, *_) = containers(find(docs, "Deployment", component))
        assert c["image"] == want, (component, c["image"])
    for kind, component in (("Deployment", "inference"), ("StatefulSet", "learner")):
        (c, *_) = containers(find(docs, kind, component))
        assert "ludic-guess" not in c["image"], (component, c["image"])
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "config.yaml" in (d.get("data") or {})]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["feeder"]["tasks"][0]["env"]["kind"] == "guess"
    # the run config the pods read builds with the package installed (as in the image)
    for i, task in enumerate(parse_tasks(config["feeder"]["tasks"], "feeder.tasks")):
        check_task(task, f"feeder.tasks[{i}]")
    errors = [
        e for d in docs if d["kind"] not in CRD_KINDS for e in k8s_errors(d, K8S_VERSIONS[-1])
    ]
    assert not errors, "\n".join(errors)
