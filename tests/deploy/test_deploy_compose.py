"""compose.yaml + deploy/prometheus + deploy/grafana, checked without a Docker engine.

Validated here: the Compose Specification JSON schema (check-jsonschema's vendored copy),
cross-references (depends_on, profiles, volumes/configs/secrets), Prometheus targets against
compose services and DEVELOPERS.md ports, LUDIC_* variables against the documented contract,
and the Grafana dashboard's queries. Image builds, container start-up, health transitions,
GPU reservations and DNS discovery of scaled replicas need a real Docker engine.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import KNOWN_METRICS, ROOT, developers_table, promtool, scrape_ports

# No conftest.py in tests/deploy on purpose: a second `conftest` module would shadow
# tests/conftest.py for modules that do `from conftest import free_port`.


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


LUDIC_SERVICES = ("inference", "actor", "credit", "learner", "feeder")


def check_jsonschema(path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("check-jsonschema")
    if not exe.exists():
        pytest.skip("check-jsonschema is not installed in this environment")
    return subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_matches_the_compose_specification():
    res = check_jsonschema(ROOT / "compose.yaml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_schema_check_rejects_a_broken_file(tmp_path, compose):
    broken = copy.deepcopy(compose)
    broken["services"]["actor"]["enviroment"] = {"LUDIC_RUN_ID": "x"}  # typo'd key
    broken["services"]["redis"]["depends_on"] = {"inference": {"condition": "when_ready"}}
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    res = check_jsonschema(path)
    assert res.returncode != 0
    assert "enviroment" in res.stdout + res.stderr


# ---------------------------------------------------------------- cross-references


def enabled_services(compose: dict[str, Any], profiles: list[str]) -> dict[str, Any]:
    return {
        n: s
        for n, s in compose["services"].items()
        if not s.get("profiles") or set(s["profiles"]) & set(profiles)
    }


def dependency_problems(compose: dict[str, Any]) -> list[str]:
    """depends_on that Compose would refuse: an undefined service, or (per active profile set)
    a required dependency disabled by its profile ("depends on undefined service")."""
    problems: list[str] = []
    defined = set(compose["services"])
    for profiles in ([], ["gpu"]):
        enabled = enabled_services(compose, profiles)
        for name, svc in enabled.items():
            deps = svc.get("depends_on", {})
            deps = {d: {} for d in deps} if isinstance(deps, list) else deps
            for dep, cfg in deps.items():
                if dep not in defined:
                    problems.append(f"{name} depends on undefined service {dep}")
                elif dep not in enabled and cfg.get("required", True):
                    problems.append(f"profiles {profiles}: {name} requires disabled service {dep}")
    return problems


def test_depends_on_names_defined_services_under_every_profile(compose):
    assert not dependency_problems(compose)


def test_dependency_check_catches_undefined_and_profile_gated_services(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["credit"]["depends_on"]["redis-typo"] = {"condition": "service_healthy"}
    broken["services"]["actor"]["depends_on"]["inference-gpu"]["required"] = True
    problems = dependency_problems(broken)
    assert any("undefined service redis-typo" in p for p in problems)
    assert any("requires disabled service inference-gpu" in p for p in problems)


def test_dependencies_wait_for_health(compose):
    for name in ("actor", "credit", "learner", "feeder"):
        deps = compose["services"][name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy", name
    for name in ("actor", "learner"):
        assert (
            compose["services"][name]["depends_on"]["inference"]["condition"] == "service_healthy"
        )


def test_named_volumes_configs_and_secrets_are_declared(compose):
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
        for cfg in svc.get("configs", []):
            assert cfg["source"] in compose["configs"]
            assert (ROOT / compose["configs"][cfg["source"]]["file"]).exists()
        for sec in svc.get("secrets", []):
            assert (sec if isinstance(sec, str) else sec["source"]) in compose["secrets"]
        for vol in svc.get("volumes", []):
            if vol.startswith("./"):
                assert (ROOT / vol.split(":")[0]).exists(), f"{name}: missing bind source {vol}"


def test_services_run_the_documented_commands_and_ports(compose):
    table = developers_table()
    svcs = compose["services"]
    for name, (port, _) in table.items():
        for variant in (name, f"{name}-gpu"):
            if variant in svcs:
                argv = svcs[variant].get("entrypoint", []) + svcs[variant]["command"]
                assert name in argv, f"{variant} does not run `ludic {name}`"
                assert str(port) in svcs[variant]["expose"], f"{variant} does not expose {port}"
    assert svcs["inference"]["command"][:2] == ["inference", "--model"]
    assert svcs["inference"]["command"][2].startswith("/models/")


def test_actor_is_scalable(compose):
    actor = compose["services"]["actor"]
    assert "container_name" not in actor and "ports" not in actor
    assert not any("container_name" in s for s in compose["services"].values())


def test_redis_persists_and_takes_its_users_from_a_secret(compose):
    """(Which users: tests/deploy/test_deploy_redis_users.py.)"""
    redis = compose["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--aclfile /run/secrets/users.acl" in cmd
    assert "--maxmemory ${REDIS_MAXMEMORY:-2gb} --maxmemory-policy noeviction" in cmd
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_long_running_services_have_healthchecks_and_restart_policies(compose):
    for name, svc in compose["services"].items():
        if name in ("model-init", "status"):  # one-shots
            assert svc["restart"] == "no"
            continue
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_gpu_profile_reserves_nvidia_devices_and_keeps_dns_names(compose):
    svcs = compose["services"]
    for name, alias in (("inference-gpu", "inference"), ("learner-gpu", "learner")):
        svc = svcs[name]
        assert svc["profiles"] == ["gpu"]
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert alias in svc["networks"]["default"]["aliases"]
    for name in LUDIC_SERVICES:
        assert not svcs[name].get("profiles"), f"{name} must run by default (CPU)"
        assert "deploy" not in svcs[name], f"CPU service {name} must not reserve devices"
    assert "torchrun" in svcs["learner-gpu"]["entrypoint"]


# ---------------------------------------------------------------- environment contract


def ludic_env(compose: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, svc in compose["services"].items():
        env = svc.get("environment", {})
        env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
        for key, value in env.items():
            if key.startswith("LUDIC_"):
                out[f"{name}:{key}"] = str(value)
    return out


def undocumented_env(compose: dict[str, Any]) -> list[str]:
    docs = (ROOT / "DEVELOPERS.md").read_text()
    deployment = ROOT / "docs" / "deployment.md"
    docs += deployment.read_text() if deployment.exists() else ""
    documented = set(re.findall(r"LUDIC_[A-Z_]+", docs))
    return sorted({k.split(":")[1] for k in ludic_env(compose)} - documented)


def test_every_ludic_env_var_is_documented(compose):
    assert not undocumented_env(compose)


def test_env_documentation_check_catches_an_unknown_variable(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["actor"]["environment"]["LUDIC_ACTOR_SPEED"] = "11"
    assert undocumented_env(broken) == ["LUDIC_ACTOR_SPEED"]


def test_services_get_the_variables_developers_md_says_they_read(compose):
    env = ludic_env(compose)
    # defaulted by the service / given as --model / the URL is read from LUDIC_REDIS_URL_FILE
    optional = {"LUDIC_MAX_LAG", "LUDIC_MODEL_DIR", "LUDIC_REDIS_URL"}
    for name, (_, reads) in developers_table().items():
        for var in set(reads) - optional:
            assert f"{name}:{var}" in env, f"{name} does not get {var}"


def test_no_service_gets_a_variable_the_settings_loader_refuses(compose):
    """A retired variable (LUDIC_INFERENCE_CONFIG, ...) stops the service at start (exit 2)."""
    from services.common.settings import _RETIRED_ENV
    from services.inference.settings import InferenceSettings

    retired = set(_RETIRED_ENV) | set(InferenceSettings.RETIRED_ENV)
    assert not [k for k in ludic_env(compose) if k.split(":")[1] in retired]


def test_no_secret_is_written_in_the_compose_file(compose):
    for key, value in ludic_env(compose).items():
        if key.endswith(("AUTH_TOKEN", "API_KEY")):
            assert "${" in value and ":?" in value, f"{key} must come from .env (${{VAR:?...}})"
        # the Redis URL (its password) is a mounted file: tests/deploy/test_deploy_redis_users.py
        assert not key.endswith(":LUDIC_REDIS_URL"), f"{key}: use LUDIC_REDIS_URL_FILE"
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"PASSWORD|TOKEN|SECRET|API_KEY", key) and not key.startswith(
                "TOKENIZERS"
            ):
                assert str(value).startswith("${") and ":?" in str(value), f"{name}:{key} is inline"


def test_the_generation_token_reaches_inference_and_every_client_of_it(compose):
    """inference requires LUDIC_API_KEY on its generation routes; the actors and the
    evaluator send it; the services that never call those routes do not get it."""
    env = ludic_env(compose)
    got = {k.split(":")[0] for k in env if k.endswith(":LUDIC_API_KEY")}
    assert got == {"inference", "inference-gpu", "actor", "eval"}, got


def test_every_ludic_container_is_hardened(compose):
    """No capabilities, no privilege through setuid files, bounded processes and memory for
    every service of the ludic image (it runs as uid 10001); Redis keeps the capabilities its
    entrypoint needs to drop root, with the other bounds."""
    ludic = {
        n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("ludic:")
    }
    assert {"inference", "actor", "credit", "learner", "feeder", "eval", "model-init"} <= set(ludic)
    for name, svc in ludic.items():
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert 0 < int(svc["pids_limit"]) <= 4096, name
        assert svc.get("read_only") is True, name
        writable = [t.split(":")[0] for t in svc.get("tmpfs", [])]
        writable += [v.split(":")[-2] if ":" in v else v.split()[0] for v in svc.get("volumes", [])]
        assert "/tmp" in writable and "/home/ludic" in writable, (name, writable)
        assert re.fullmatch(r"\$\{[A-Z_]+_MEM_LIMIT:-\d+g\}", svc["mem_limit"]), name
    redis = compose["services"]["redis"]
    assert "no-new-privileges:true" in redis["security_opt"] and redis["pids_limit"] <= 256
    assert "mem_limit" in redis


# ---------------------------------------------------------------- Prometheus targets


def scrape_targets(prom: dict[str, Any]) -> list[tuple]:
    out = []
    for job in prom["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                out.append((job["job_name"], host, int(port)))
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                out.append((job["job_name"], host, int(sd["port"])))
    return out


def target_problems(compose: dict[str, Any], prom: dict[str, Any]) -> list[str]:
    problems = []
    svcs = compose["services"]
    names = {n: n for n in svcs}
    for n, s in svcs.items():  # network aliases answer for a service too (gpu variants)
        for alias in (s.get("networks", {}).get("default") or {}).get("aliases", []):
            names.setdefault(alias, n)
    for job, host, port in scrape_targets(prom):
        if host not in names:
            problems.append(f"{job}: {host} is not a compose service")
            continue
        owners = [
            n
            for n, s in svcs.items()
            if n == host
            or host in ((s.get("networks", {}).get("default") or {}).get("aliases", []))
        ]
        for owner in owners:
            exposed = {
                int(str(p).split(":")[-1].split("/")[0]) for p in svcs[owner].get("expose", [])
            }
            if port not in exposed:
                problems.append(f"{job}: {owner} does not expose {port}")
    return problems


@pytest.fixture(scope="module")
def prometheus_config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())


def test_every_scrape_target_is_a_compose_service_and_port(compose, prometheus_config):
    assert not target_problems(compose, prometheus_config)


def test_every_ludic_service_is_scraped_on_its_documented_port(prometheus_config):
    targets = {(h, p) for _, h, p in scrape_targets(prometheus_config)}
    for name, port in scrape_ports().items():
        assert (name, port) in targets, f"{name}:{port} is not scraped"


def test_target_check_catches_a_wrong_port(compose, prometheus_config):
    broken = copy.deepcopy(prometheus_config)
    broken["scrape_configs"][1]["dns_sd_configs"][0]["port"] = 9999
    broken["scrape_configs"].append(
        {"job_name": "x", "static_configs": [{"targets": ["nohost:1"]}]}
    )
    problems = target_problems(compose, broken)
    assert any("does not expose 9999" in p for p in problems)
    assert any("nohost is not a compose service" in p for p in problems)


def test_prometheus_and_grafana_mounts_point_at_deploy(compose):
    prom = compose["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    graf = compose["services"]["grafana"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in graf["volumes"]


# ---------------------------------------------------------------- Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((ROOT / "deploy/grafana/dashboards/ludic.json").read_text())


def dashboard_exprs(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in dashboard["panels"]}


def test_dashboard_shows_the_required_signals(dashboard):
    exprs = " ".join(e for es in dashboard_exprs(dashboard).values() for e in es)
    for metric in (
        "ludic_actor_reward",
        "ludic_learner_samples_per_second",
        "ludic_learner_tokens_per_second",
        "ludic_stream_length",
        "ludic_learner_stale_dropped_total",
        "ludic_learner_replica_acked_version",
        "ludic_learner_publish_seconds_bucket",
        "ludic_learner_train_signal",
        "ludic_learner_grad_norm",
        "ludic_learner_lr",
        "ludic_learner_nonfinite_steps_skipped_total",
        "ludic_learner_batch_wait_fraction",
        "ludic_credit_groups_total",
    ):
        assert metric in exprs, f"dashboard lacks {metric}"
    lag = dashboard_exprs(dashboard)["Policy version lag per replica"]
    assert any("ludic_learner_policy_version" in e for e in lag)
    legends = [
        t["legendFormat"]
        for p in dashboard["panels"]
        if p["title"] == "Policy version lag per replica"
        for t in p["targets"]
    ]
    assert legends == ["{{replica}}"]


# A training-signal panel selects loss statistics (and the Trainer's step stats exported beside
# them, adv_mean / adv_std) as (.+/)?name or (.+/)?(name|name...): the optional prefix is
# CompositeLoss's "<term>/" (grpo with a KL term reports pg/clip_frac, kl/kl).
SIGNAL_SELECTOR = re.compile(r'ludic_learner_train_signal\{signal=~"([^"]*)"\}')
SIGNAL_REGEX = re.compile(r"\(\.\+/\)\?(?:\(([a-z_]+(?:\|[a-z_]+)*)\)|([a-z_]+))")


def emitted_signals() -> tuple[set[str], set[str]]:
    """(the stat keys of every loss a run can name plus the step stats the learner exports
    as signals, ``STEP_SIGNALS``; the ``signal`` labels of every preset's loss with a KL
    term), both without "loss" (it has its own gauge, services/learner)."""
    from libludic.training.components import LOSSES
    from libludic.training.preset_options import preset_arguments
    from libludic.training.presets import ALGORITHMS
    from services.learner.metrics import STEP_SIGNALS

    keys = {k for cls in LOSSES.values() if isinstance(cls.stat_keys, tuple) for k in cls.stat_keys}
    # one label, one meaning: a step stat never shares its name with a loss stat
    assert not keys & set(STEP_SIGNALS), keys & set(STEP_SIGNALS)
    keys |= set(STEP_SIGNALS)
    labels = set()
    for name, make in ALGORITHMS.items():
        if name != "custom":
            kw = {"kl_coeff": 0.1} if "kl_coeff" in preset_arguments(make) else {}
            if name == "dapo":  # its overlong shaping needs the run's generation budget
                kw.update(max_new_tokens=64, overlong_tokens=16)
            labels |= set(make(**kw).loss.stat_keys)
    keys.discard("loss")
    return keys, {k for k in labels if k.rsplit("/", 1)[-1] != "loss"}


def test_dashboard_training_signal_panels_select_only_emitted_stats(dashboard):
    """Every stat name a training-signal panel selects is one a loss emits, so a renamed stat
    fails here, and each selector matches the preset losses' prefixed labels too."""
    keys, labels = emitted_signals()
    assert labels and {k.rsplit("/", 1)[-1] for k in labels} <= keys
    panels = [
        p
        for p in dashboard["panels"]
        if any("ludic_learner_train_signal" in t["expr"] for t in p.get("targets", []))
    ]
    assert len(panels) >= 6, [p["title"] for p in panels]
    for p in panels:
        for t in p["targets"]:
            selectors = SIGNAL_SELECTOR.findall(t["expr"])
            assert len(selectors) == 1, f"{p['title']}: select the stats by name: {t['expr']}"
            m = SIGNAL_REGEX.fullmatch(selectors[0])
            assert m, f"{p['title']}: {selectors[0]!r} is not (.+/)?name or (.+/)?(a|b)"
            names = (m[1] or m[2]).split("|")
            assert set(names) <= keys, f"{p['title']}: no loss emits {set(names) - keys}"
            assert "{{signal}}" in t["legendFormat"], p["title"]
            prefixed = {k for k in labels if k.rsplit("/", 1)[-1] in names}
            for label in prefixed | set(names):
                assert re.fullmatch(selectors[0], label), (p["title"], label)
            for label in (labels - prefixed) | (keys - set(names)):
                assert not re.fullmatch(selectors[0], label), (p["title"], label)


def test_dashboard_signal_panels_show_entropy_weight_maxima_and_advantage_spread(dashboard):
    """The exact entropy, the importance weights' means and maxima and the
    batch's advantage mean and std each have their panel, under the names the code emits."""
    from libludic.training.loss import OffPolicyCorrection, TokenClippedSurrogateLoss
    from services.learner.metrics import STEP_SIGNALS

    shown: dict[str, set[str]] = {}
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            for selector in SIGNAL_SELECTOR.findall(t["expr"]):
                m = SIGNAL_REGEX.fullmatch(selector)
                assert m, selector
                shown.setdefault(p["title"], set()).update((m[1] or m[2]).split("|"))
    surrogate = set(TokenClippedSurrogateLoss.stat_keys)
    weights = {k for k in surrogate | set(OffPolicyCorrection.stat_keys) if "weight" in k}
    weights |= {k for k in surrogate if k.startswith("ratio_")}
    assert shown["Entropy"] == {"entropy"} <= surrogate
    assert shown["Importance weights (mean, max)"] == weights
    assert weights == {"ratio_mean", "ratio_max", "mismatch_weight_mean", "mismatch_weight_max"}
    assert shown["Advantages (mean, std)"] == set(STEP_SIGNALS) == {"adv_mean", "adv_std"}


def test_dashboard_dynamic_sampling_panel_counts_the_credit_workers_drops(dashboard):
    import services.credit.worker as credit

    (panel,) = [p for p in dashboard["panels"] if p["title"] == "Dynamic-sampling drops"]
    exprs = " ".join(t["expr"] for t in panel["targets"])
    (family,) = credit.GROUPS.describe()
    assert f"{family.name}_total{{" in exprs
    (outcome,) = set(re.findall(r'outcome="([a-z_]+)"', exprs))
    assert f'"{outcome}"' in inspect.getsource(credit.CreditWorker._process_group)


def test_dashboard_panels_do_not_overlap(dashboard):
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_dashboard_uses_only_exported_metrics(dashboard):
    used = set()
    for es in dashboard_exprs(dashboard).values():
        for e in es:
            used |= set(re.findall(r"\bludic_[a-z_]+\b", e))
    assert used <= KNOWN_METRICS, used - KNOWN_METRICS


def test_the_known_learner_metrics_are_the_learners_own():
    """KNOWN_METRICS is written by hand: its learner names must be ones the learner defines
    (counters are exported with _total, histograms with _bucket/_sum/_count)."""
    from prometheus_client import REGISTRY

    import services.learner.metrics  # noqa: F401  (registers them)

    exported = set()
    for family in REGISTRY.collect():
        if family.type == "counter":
            exported.add(family.name + "_total")
        elif family.type == "histogram":
            exported |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            exported.add(family.name)
    learner = {m for m in KNOWN_METRICS if m.startswith("ludic_learner_")}
    assert learner and learner <= exported, learner - exported


def test_dashboard_datasource_is_the_provisioned_one(dashboard):
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    (source,) = ds["datasources"]
    assert source["url"] == "http://prometheus:9090"
    (var,) = dashboard["templating"]["list"]
    assert var["current"]["value"] == source["uid"]
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/ludic.yml").read_text())
    graf = {
        v.split(":")[1]: v.split(":")[0]
        for v in (
            yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["grafana"]["volumes"]
        )
    }
    assert graf[prov["providers"][0]["options"]["path"]] == "./deploy/grafana/dashboards"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_queries_are_valid_promql(dashboard, tmp_path):
    """promtool parses every panel query (wrapped as recording rules)."""
    exe = promtool()
    exprs = [e for es in dashboard_exprs(dashboard).values() for e in es]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run(
        [exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    # and the same check rejects a broken query
    rules["groups"][0]["rules"][0]["expr"] = "sum(rate(ludic_actor_reward_sum[5m])"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run(
        [exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode != 0


def test_a_users_override_runs_their_image_where_their_kinds_are_built(compose):
    """examples/custom_env/deploy/compose.yaml over compose.yaml (README "Bring your own
    environment"): the warm start, feeder, actor, credit, learner and eval run the user's
    image, built FROM the project's; inference keeps the project's; every service mounts
    the user's run config. Merged as Compose merges an override (a service's keys replace
    the base's)."""
    override = yaml.safe_load((ROOT / "examples/custom_env/deploy/compose.yaml").read_text())
    res = check_jsonschema(ROOT / "examples/custom_env/deploy/compose.yaml")
    assert res.returncode == 0, res.stdout + res.stderr
    merged = copy.deepcopy(compose)
    for name, body in override["services"].items():
        assert name in merged["services"], f"the override names no service {name!r}"
        merged["services"][name].update(body)
    merged["configs"].update(override["configs"])
    users = {"model-init", "feeder", "actor", "credit", "learner", "eval"}
    for name in users:
        svc = merged["services"][name]
        assert svc["image"] == "${LUDIC_USER_IMAGE:-ludic-guess:cpu}", name
        build = svc["build"]  # a service's build keys from the override replace the base's
        assert build["context"] == "examples/custom_env", name
        assert (build["dockerfile"], build["target"]) == ("Dockerfile", "user"), name
    assert "ludic-guess" not in merged["services"]["inference"]["image"]
    config = merged["configs"]["ludic-config"]["file"]
    assert (ROOT / config).is_file() and config.endswith("examples/custom_env/grpo.yaml")
    dockerfile = (ROOT / "examples/custom_env/Dockerfile").read_text()
    assert "FROM ${LUDIC_IMAGE} AS user" in dockerfile and "ARG LUDIC_IMAGE=ludic:cpu" in dockerfile
