"""Redis users in compose.yaml and the Helm chart, as ``ludic up`` has them
(services/common/redis_acl.py, the one definition of the rules).

Checked for both, offline: every service that talks to Redis connects as its own role's user
(``ludic-<role>``) through a URL read from a mounted secret file (LUDIC_REDIS_URL_FILE), and
no environment carries a Redis password; Redis starts from ACL lines equal to
``RunUsers.acl_config`` (the default user off, the admin, one user per role), never from a
password in its arguments; its probe and ``ludic status`` use the admin, which no service
gets. compose mounts the files ``python -m services.common.redis_acl`` writes; the chart
renders the same lines in a template, and the test below holds them equal. That Redis admits
exactly these users with these rights is tests/integration/test_redis_acl.py (a real
redis-server on the written files); that the containers start is tests/containers.
"""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import (
    NAMESPACE,
    RELEASE,
    ROOT,
    SCENARIOS,
    WORKLOAD_KINDS,
    Doc,
    by_kind,
    containers,
    find,
    parse_docs,
    render,
    rendered,
    scenario_values,
)

from services.common.redis_acl import (
    ACL_FILE,
    ADMIN,
    ROLES,
    RunUsers,
    secret_name,
    write_secrets,
)

URL_FILE = "/run/secrets/ludic/redis-url"
SECRETS_DIR = "./deploy/compose/secrets"
# compose service -> the Redis user it connects as (role, or the admin)
COMPOSE_ROLE = {
    "actor": "actor",
    "credit": "credit",
    "learner": "learner",
    "learner-gpu": "learner",
    "feeder": "feeder",
    "eval": "eval",
    "status": ADMIN,
}
# never in an environment: the URL with its password, the password, redis-cli's password
SECRET_ENV = {"LUDIC_REDIS_URL", "REDIS_PASSWORD", "REDISCLI_AUTH"}
CREDENTIALS = re.compile(r"rediss?://[^/\s]*@")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def env_of(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
    return {k: str(v) for k, v in env.items()}


def compose_env_leaks(compose: dict[str, Any]) -> list[str]:
    leaks = []
    for name, svc in compose["services"].items():
        for key, value in env_of(svc).items():
            if key in SECRET_ENV or CREDENTIALS.search(value) or "REDIS_PASSWORD" in value:
                leaks.append(f"{name}: {key}")
    return leaks


def test_no_compose_environment_carries_a_redis_password(compose):
    assert not compose_env_leaks(compose)
    text = (ROOT / "compose.yaml").read_text()
    assert "REDIS_PASSWORD" not in text and "requirepass" not in text


def test_compose_env_leak_check_catches_a_url_with_a_password(compose):
    broken = yaml.safe_load(yaml.safe_dump(compose))
    broken["services"]["actor"]["environment"]["LUDIC_REDIS_URL"] = "redis://u:p@redis:6379/0"
    broken["services"]["feeder"]["environment"]["X"] = "rediss://:p@redis:6379/0"
    assert compose_env_leaks(broken) == ["actor: LUDIC_REDIS_URL", "feeder: X"]


def test_every_compose_redis_client_reads_its_own_roles_url_file(compose, tmp_path):
    svcs = compose["services"]
    clients = {n for n, s in svcs.items() if "LUDIC_REDIS_URL_FILE" in env_of(s)}
    assert clients == set(COMPOSE_ROLE)
    written = tmp_path / "secrets"
    write_secrets(written, "compose", "redis")
    mounted_by: dict[str, set[str]] = {}
    for name, role in COMPOSE_ROLE.items():
        assert env_of(svcs[name])["LUDIC_REDIS_URL_FILE"] == URL_FILE, name
        (sec,) = [s for s in svcs[name]["secrets"] if s["target"] == URL_FILE]
        mounted_by.setdefault(sec["source"], set()).add(name)
        file = compose["secrets"][sec["source"]]["file"]
        assert file == f"{SECRETS_DIR}/{secret_name(role, 'url')}", name
        # the file of that name is the role's own user, at the compose service `redis`
        user = ADMIN if role == ADMIN else f"ludic-{role}"
        url = (written / Path(file).name).read_text()
        assert re.fullmatch(rf"redis://{user}:[0-9a-f]{{48}}@redis:6379/0", url), url
    # one URL per role: no two roles share a secret; the admin's only `ludic status`
    assert len(mounted_by) == len(set(COMPOSE_ROLE.values())) == len(ROLES) + 1
    assert mounted_by["redis-url-admin"] == {"status"}
    for name in ("inference", "inference-gpu", "model-init", "prometheus", "grafana"):
        assert not svcs[name].get("secrets"), f"{name} never talks to Redis"


def test_compose_redis_starts_from_the_rendered_users_with_the_default_user_off(compose, tmp_path):
    redis = compose["services"]["redis"]
    (cmd,) = redis["command"]
    assert cmd.rstrip().endswith("--aclfile /run/secrets/users.acl")
    mounts = {s["target"]: compose["secrets"][s["source"]]["file"] for s in redis["secrets"]}
    assert mounts == {
        ACL_FILE: f"{SECRETS_DIR}/{ACL_FILE}",
        "admin-password": f"{SECRETS_DIR}/{secret_name(ADMIN, 'password')}",
    }
    # what that file holds: `ludic up`'s lines, with hashes for passwords
    users = write_secrets(tmp_path / "secrets", "compose", "redis")
    acl = (tmp_path / "secrets" / ACL_FILE).read_text()
    assert acl == users.acl_config(hashed=True)
    assert acl.splitlines()[0] == "user default off resetpass ~* &* +@all"
    assert not any(pw in acl for pw in users.passwords.values())
    # the healthcheck is the admin's
    probe = " ".join(redis["healthcheck"]["test"])
    assert "--user ludic-admin" in probe and "/run/secrets/admin-password" in probe


def compose_redis_guard(
    compose: dict[str, Any], run_id: str, acl: Path
) -> subprocess.CompletedProcess:
    """The redis command up to its `exec`, as compose runs it: LUDIC_RUN_ID interpolated,
    `$$` unescaped, users.acl at ``acl``."""
    (cmd,) = compose["services"]["redis"]["command"]
    script = cmd.split("exec docker-entrypoint.sh")[0] + "echo started"
    script = script.replace("${LUDIC_RUN_ID:-compose}", run_id).replace("$$", "$")
    script = script.replace("/run/secrets/users.acl", str(acl))
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)


@pytest.mark.parametrize("run_id", ["compose", r"a*b?[c]\d"])
def test_compose_redis_refuses_users_of_another_run_naming_the_fix(compose, tmp_path, run_id):
    """A users.acl written for another LUDIC_RUN_ID would give every service NOPERM: Redis
    does not start, and says which command writes the right one (glob characters of a run
    id are matched as redis_acl.key_pattern escapes them)."""
    write_secrets(tmp_path, run_id, "redis")
    ok = compose_redis_guard(compose, run_id, tmp_path / ACL_FILE)
    assert ok.returncode == 0 and ok.stdout == "started\n", ok.stderr
    bad = compose_redis_guard(compose, "other", tmp_path / ACL_FILE)
    assert bad.returncode == 1 and not bad.stdout
    assert "--run-id 'other' --host redis" in bad.stderr


# ---------------------------------------------------------------- the Helm chart

ALL = ["default", *SCENARIOS]
# chart component -> (its kind, the role whose user it connects as)
CHART_ROLE = {
    "actor": ("Deployment", "actor"),
    "credit": ("Deployment", "credit"),
    "learner": ("StatefulSet", "learner"),
    "feeder": ("Deployment", "feeder"),
    "eval": ("Deployment", "eval"),
}
REDIS_HOST = f"{RELEASE}-ludic-redis.{NAMESPACE}.svc.cluster.local"
CHART_SECRET = f"{RELEASE}-ludic-redis"


def pods(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    """(workload, pod spec) of every workload."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in WORKLOAD_KINDS]


def chart_env_leaks(docs: list[Doc]) -> list[str]:
    leaks = []
    for d, pod in pods(docs):
        for c in pod["containers"] + pod.get("initContainers", []):
            where = f"{d['metadata']['name']}/{c['name']}"
            for env in c.get("env", []):
                if env["name"] in SECRET_ENV or CREDENTIALS.search(str(env.get("value", ""))):
                    leaks.append(f"{where}: {env['name']}")
            if c.get("envFrom"):
                leaks.append(f"{where}: envFrom")
            argv = " ".join(c.get("command", []) + c.get("args", []))
            if CREDENTIALS.search(argv) or "requirepass" in argv or "$(REDIS" in argv:
                leaks.append(f"{where}: argv")
    return leaks


def decoded(secret: Doc) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def redis_secret(docs: list[Doc]) -> dict[str, str]:
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == CHART_SECRET]
    return decoded(secret)


def expected_secret_name(values: dict[str, Any]) -> str:
    bundled = values.get("redis", {}).get("enabled", True)
    given = (values.get("redis", {}).get("auth", {}) if bundled else values["externalRedis"]).get(
        "existingSecret"
    )
    return given or CHART_SECRET


@pytest.mark.parametrize("scenario", ALL)
def test_no_chart_environment_or_argument_carries_a_redis_password(scenario):
    assert not chart_env_leaks(rendered(scenario))


def test_chart_env_leak_check_catches_a_password_variable():
    docs = rendered("default")
    containers(find(docs, "Deployment", "credit"))[0]["env"].append(
        {"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {"name": "x", "key": "y"}}}
    )
    assert chart_env_leaks(docs) == [f"{RELEASE}-ludic-credit/credit: REDISCLI_AUTH"]


@pytest.mark.parametrize("scenario", ALL)
def test_every_chart_redis_client_mounts_its_own_roles_url(scenario):
    docs = rendered(scenario)
    secret = expected_secret_name(scenario_values(scenario))
    clients = set()
    for d, pod in pods(docs):
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "LUDIC_REDIS_URL_FILE" not in env:
                continue
            component = d["metadata"]["labels"]["app.kubernetes.io/component"]
            kind, role = CHART_ROLE[component]
            clients.add(component)
            assert (d["kind"], env["LUDIC_REDIS_URL_FILE"]) == (kind, URL_FILE), component
            (mount,) = [m for m in c["volumeMounts"] if URL_FILE.startswith(m["mountPath"] + "/")]
            (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert vol["secret"]["secretName"] == secret, component
            # its own role's URL and nothing else of the Secret
            assert vol["secret"]["items"] == [{"key": f"{role}-url", "path": "redis-url"}]
    assert clients == set(CHART_ROLE)
    # nothing else mounts the Redis Secret but Redis itself (its ACL file and admin password)
    for d, pod in pods(docs):
        component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        if component not in (*CHART_ROLE, "redis"):
            assert all(v.get("secret", {}).get("secretName") != secret for v in pod["volumes"])


@pytest.mark.parametrize("scenario", ["default", "keda", "cpu-minimal"])
def test_the_charts_users_are_redis_acls(scenario, tmp_path):
    """The chart's Secret holds what ``python -m services.common.redis_acl`` writes (the same
    keys) and its ACL lines are ``RunUsers.acl_config`` of the run id: the template's rules
    are role_rules, the default user is off, the admin has every right."""
    data = redis_secret(rendered(scenario))
    run_id = scenario_values(scenario).get("runId") or RELEASE
    passwords = {role: data[secret_name(role, "password")] for role in (ADMIN, *ROLES)}
    users = RunUsers(run_id, passwords)
    assert data[ACL_FILE] == users.acl_config(hashed=True)
    assert data[ACL_FILE].splitlines()[0] == "user default off resetpass ~* &* +@all"
    for role in (ADMIN, *ROLES):
        assert data[secret_name(role, "url")] == users.url(role, REDIS_HOST, 6379)
        assert re.fullmatch(r"[A-Za-z0-9]{40}", passwords[role])  # generated, URL-safe
    assert len(set(passwords.values())) == len(passwords)
    write_secrets(tmp_path, run_id, REDIS_HOST)
    assert set(data) == {p.name for p in tmp_path.iterdir()}


def chart_redis(docs: list[Doc]) -> tuple[Doc, Doc]:
    sts = find(docs, "StatefulSet", "redis")
    (c,) = containers(sts)
    return c, sts["spec"]["template"]["spec"]


@pytest.mark.parametrize("scenario", [s for s in ALL if s != "external-redis"])
def test_chart_redis_starts_from_the_secrets_users_with_the_default_user_off(scenario):
    docs = rendered(scenario)
    c, pod = chart_redis(docs)
    assert c["command"] == ["sh", "-c"]
    (script,) = c["args"]
    assert script.rstrip().endswith("--aclfile /etc/redis-users/users.acl")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/etc/redis-users"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"]["secretName"] == expected_secret_name(scenario_values(scenario))
    keys = [i["key"] for i in vol["secret"]["items"]]
    assert keys == [ACL_FILE, secret_name(ADMIN, "password")]
    for probe in ("livenessProbe", "readinessProbe"):
        cmd = " ".join(c[probe]["exec"]["command"])
        assert "--user ludic-admin" in cmd and "/etc/redis-users/admin-password" in cmd


def chart_redis_guard(script: str, acl: Path) -> subprocess.CompletedProcess:
    script = script.split("exec redis-server")[0] + "echo started"
    script = script.replace("/etc/redis-users/users.acl", str(acl))
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)


def test_chart_redis_refuses_users_of_another_run_naming_the_fix(tmp_path):
    """An existingSecret written for another run id: Redis does not start, and says how to
    write the right one."""
    (script,) = chart_redis(rendered("gpu"))[0]["args"]
    write_secrets(tmp_path / "ok", RELEASE, REDIS_HOST)
    ok = chart_redis_guard(script, tmp_path / "ok" / ACL_FILE)
    assert ok.returncode == 0 and ok.stdout == "started\n", ok.stderr
    write_secrets(tmp_path / "bad", "other", REDIS_HOST)
    bad = chart_redis_guard(script, tmp_path / "bad" / ACL_FILE)
    assert bad.returncode == 1 and not bad.stdout
    assert f"--run-id {RELEASE} --host {REDIS_HOST}" in bad.stderr


def test_external_redis_with_a_shared_password_gives_it_to_every_role():
    values = {
        "redis": {"enabled": False},
        "externalRedis": {"url": "rediss://redis.example:6380/2", "password": "pw-1"},
    }
    docs = parse_docs(render(values))
    want = {f"{role}-url": "rediss://:pw-1@redis.example:6380/2" for role in ROLES}
    assert redis_secret(docs) == want
    assert "redis" not in {d["metadata"]["labels"].get("app.kubernetes.io/component") for d in docs}


def test_external_redis_per_role_urls_come_from_its_existing_secret():
    docs = rendered("external-redis")
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == CHART_SECRET]
    # (each component mounts its key of managed-redis: test_every_chart_redis_client_...)


def test_external_redis_without_auth_renders_only_when_allowed():
    helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk not installed")
    values = {"redis": {"enabled": False}, "externalRedis": {"url": "redis://redis:6379/0"}}
    with pytest.raises(helm_python.HelmError, match="externalRedis has no password"):
        render(values)
    values["externalRedis"]["allowNoAuth"] = True
    urls = redis_secret(parse_docs(render(values)))
    assert urls == {f"{role}-url": "redis://redis:6379/0" for role in ROLES}
