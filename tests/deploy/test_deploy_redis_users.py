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

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import ROOT

from services.common.redis_acl import ACL_FILE, ADMIN, ROLES, secret_name, write_secrets

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
