"""compose.yaml and the Helm chart run the same six services the same way.

Both files are read as data: compose.yaml with PyYAML (merge keys expanded), the chart rendered by
Helm's Go engine with its default values (GPU inference/learner, as compose's `gpu` profile) and
with `gpus: 0` (CPU, as compose's default services). Compared per service: the image repository name, the container ports, the names of
the environment variables the service reads, and the health probe (path + port). Compose probes
through the image's `ludic-healthcheck`, whose per-service URL table is read from the script.
"""

from __future__ import annotations

import importlib.util
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_support import ROOT, Doc, containers, find, parse_docs, render, rendered

pytest.importorskip("helm_python", reason="helm-python-sdk not installed")

# service -> (kind in the chart, compose service of the CPU default, compose service of the GPU profile)
SERVICES: dict[str, tuple[str, str, str]] = {
    "inference": ("Deployment", "inference", "inference-gpu"),
    "actor": ("Deployment", "actor", "actor"),
    "credit": ("Deployment", "credit", "credit"),
    "learner": ("StatefulSet", "learner", "learner-gpu"),
    "feeder": ("Deployment", "feeder", "feeder"),
    "eval": ("Deployment", "eval", "eval"),
}
# the Redis clients: the role whose user each connects as (its URL: a mounted file)
REDIS_ROLE = {c: c for c in ("actor", "credit", "learner", "feeder", "eval")}


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


# compose.yaml's default (no profile) runs vLLM and the learner on CPU
CPU_VALUES = {"inference": {"gpus": 0}, "learner": {"gpus": 0}}


def chart_container(component: str, cpu: bool = False) -> Doc:
    docs = parse_docs(render(CPU_VALUES)) if cpu else rendered("default")
    kind = SERVICES[component][0]
    (c,) = containers(find(docs, kind, component))
    return c


def healthcheck_probes() -> dict[str, str]:
    path = ROOT / "deploy" / "docker" / "ludic-healthcheck.py"
    spec = importlib.util.spec_from_file_location("ludic_healthcheck", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.PROBES)


def repository_name(image: str) -> str:
    """ghcr.io/ludic/ludic:0.1.0-cpu -> ludic; ludic:cpu -> ludic (digest/tag dropped)."""
    name = image.split("@")[0].rsplit("/", 1)[-1]
    return name.split(":")[0]


def compose_ports(svc: dict[str, Any]) -> set[int]:
    ports = {int(p) for p in svc.get("expose", [])}
    for p in svc.get("ports", []):  # "127.0.0.1:8000-8007:8000" -> container port 8000
        ports.add(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
    return ports


def chart_env_names(c: Doc) -> set[str]:
    names = {e["name"] for e in c.get("env", [])}
    assert not c.get("envFrom"), f"{c['name']}: envFrom hides variable names from this check"
    return names


def chart_probes(c: Doc) -> list[tuple[str, int]]:
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    out = []
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if kind in c:
            get = c[kind]["httpGet"]
            port = get["port"]
            out.append((get["path"], ports[port] if isinstance(port, str) else int(port)))
    return out


@pytest.mark.parametrize("component", SERVICES)
def test_same_image_repository(component):
    chart = repository_name(chart_container(component)["image"])
    for svc in SERVICES[component][1:]:
        assert repository_name(compose()[svc]["image"]) == chart, (component, svc)


@pytest.mark.parametrize("component", SERVICES)
def test_same_container_ports(component):
    chart = {p["containerPort"] for p in chart_container(component)["ports"]}
    for svc in SERVICES[component][1:]:
        assert compose_ports(compose()[svc]) == chart, (component, svc)


@pytest.mark.parametrize("component", SERVICES)
def test_same_environment_variable_names(component):
    _, cpu_svc, gpu_svc = SERVICES[component]
    # chart defaults are the GPU variant (inference.gpus: 1, learner.gpus: 1): the GPU profile
    chart = chart_env_names(chart_container(component))
    assert set(compose()[gpu_svc].get("environment", {})) == chart, (component, gpu_svc)
    # the CPU variant (adds vLLM's CPU KV-cache size for inference): defaults + gpus 0
    chart_cpu = chart_env_names(chart_container(component, cpu=True))
    assert set(compose()[cpu_svc].get("environment", {})) == chart_cpu, (component, cpu_svc)


@pytest.mark.parametrize("component", SERVICES)
def test_same_redis_url_file_of_the_same_role(component):
    """Both read the URL from the same path, a file of the component's own role (compose:
    the secret `redis-url-<role>`; the chart: the Redis Secret's key `<role>-url`)."""
    c = chart_container(component)
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    path = env.get("LUDIC_REDIS_URL_FILE")
    for svc in SERVICES[component][1:]:
        assert compose()[svc].get("environment", {}).get("LUDIC_REDIS_URL_FILE") == path, svc
    if component not in REDIS_ROLE:
        assert path is None
        return
    role = REDIS_ROLE[component]
    for svc in SERVICES[component][1:]:
        targets = {s["target"]: s["source"] for s in compose()[svc]["secrets"]}
        assert targets[path] == f"redis-url-{role}", svc
    docs = rendered("default")
    pod = find(docs, SERVICES[component][0], component)["spec"]["template"]["spec"]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"]["items"] == [{"key": f"{role}-url", "path": path.rsplit("/", 1)[1]}]


@pytest.mark.parametrize("component", SERVICES)
def test_same_health_probe_path_and_port(component):
    url = urlsplit(healthcheck_probes()[component])
    expected = (url.path, url.port)
    for svc in SERVICES[component][1:]:
        hc = compose()[svc]["healthcheck"]
        assert hc["test"] == ["CMD", "ludic-healthcheck"], (svc, hc)
        assert "HEALTHCHECK_URL" not in compose()[svc].get("environment", {}), svc
    probes = chart_probes(chart_container(component))
    assert probes, f"{component}: no HTTP probes in the chart"
    assert set(probes) == {expected}, (component, probes, expected)
