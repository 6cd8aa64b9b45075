"""Per-role Redis users (services/common/redis_acl.py) on a real redis-server: a role's user
reaches its run's keys with the commands the services use, and gets NOPERM on the
administrative and dangerous commands and on another run's keys; the default user is off.
The files ``python -m services.common.redis_acl`` writes for compose and the chart start a
redis-server (``--aclfile``) with the same users."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from libludic import transport as t
from services import status
from services.common.redis_acl import (
    ACL_FILE,
    ADMIN,
    ROLES,
    RunUsers,
    key_pattern,
    main,
    secret_name,
)
from services.launcher.stack import free_port, redis_server_binary

pytestmark = pytest.mark.integration


class AclRedis:
    """redis-server with the run's users on stdin (as ``ludic up`` starts it), append-only
    with fsync on every write, restartable on the same data."""

    def __init__(self, workdir: Path) -> None:
        self.users = RunUsers("run-a")
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = (
            f'port {self.port}\nbind 127.0.0.1\ndir {self.workdir}\nsave ""\n'
            "appendonly yes\nappendfsync always\n" + self.users.acl_config()
        )
        self.proc = subprocess.Popen(
            [redis_server_binary(), "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(conf.encode())
        self.proc.stdin.close()
        admin = redis.Redis.from_url(self.users.url(ADMIN, "127.0.0.1", self.port))
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis died"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AclRedis]:
    s = AclRedis(tmp_path)
    s.start()
    yield s
    s.kill()


@pytest.fixture
def acl_redis(server: AclRedis) -> tuple[RunUsers, int]:
    return server.users, server.port


def as_role(users: RunUsers, port: int, role: str) -> redis.Redis:
    return redis.Redis.from_url(users.url(role, "127.0.0.1", port))


DENIED = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "GET", "maxmemory"),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("REPLICAOF", "127.0.0.1", "1"),
    ("SHUTDOWN", "NOSAVE"),
    ("ACL", "SETUSER", "x", "on", ">p", "+@all"),
    ("ACL", "LIST"),
    ("KEYS", "*"),
    ("SCRIPT", "FLUSH"),
    ("CLIENT", "KILL", "ID", "1"),
]


@pytest.mark.parametrize("role", ROLES)
def test_a_role_gets_noperm_on_admin_commands_and_other_runs_keys(acl_redis, role) -> None:
    users, port = acl_redis
    r = as_role(users, port, role)
    for cmd in DENIED:
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(*cmd)
    other = t.Keys("run-b")
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.xadd(other.requests, {"d": b"x"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.get(other.policy_version)
    # a script may not reach another run's keys either (Redis checks each call in it)
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.eval("return redis.call('GET', KEYS[1])", 1, other.policy_version)
    with pytest.raises(
        redis.exceptions.ResponseError, match="can.t access at least one of the keys"
    ):
        r.eval("return redis.call('GET', ARGV[1])", 0, other.policy_version)
    # ... and its own run's keys with the commands the services use
    mine = t.Keys("run-a")
    r.xadd(mine.requests, {"d": b"x"})
    r.xgroup_create(mine.rollouts, "g", id="0", mkstream=True)
    r.xreadgroup("g", "c", {mine.rollouts: ">"}, count=1, block=10)
    r.set(mine.policy_version, 3)
    r.hset(mine.admission, mapping={"served_step": 1})
    assert r.evalsha(r.script_load("return redis.call('GET', KEYS[1])"), 1, mine.policy_version)
    with r.pipeline(transaction=True) as p:
        p.incr(mine.feeder_seed).expire(mine.feeder_seed, 60).execute()
    list(r.scan_iter(match=mine.heartbeat_pattern("actor")))
    assert r.ping()


def test_only_the_feeder_reads_info_and_the_default_user_is_off(acl_redis) -> None:
    users, port = acl_redis
    assert "used_memory" in as_role(users, port, "feeder").info("memory")
    with pytest.raises(redis.exceptions.NoPermissionError):
        as_role(users, port, "actor").info("memory")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port, password=users.passwords["actor"]).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=port, username="ludic-actor", password="wrong").ping()
    # the admin (the launcher's) can do everything
    assert as_role(users, port, ADMIN).config_get("maxmemory")


def test_glob_characters_of_a_run_id_are_matched_literally() -> None:
    assert key_pattern("a*b?[c]") == r"ludic:{a\*b\?\[c\]}:*"


def test_transactions_and_script_effects_survive_a_restart(server: AclRedis) -> None:
    """redis-server replays its append-only file as the default user and re-checks each
    MULTI/EXEC (script effects are written as one) against it: with a default user without
    permissions they were silently dropped on restart (the run's accounting lost its counts
    after a Redis kill); the default user is off but keeps its permissions for that."""
    keys = t.Keys("run-a")
    r = as_role(server.users, server.port, "learner")
    with r.pipeline(transaction=True) as p:
        p.incrby(keys.learner_step, 5).hset(keys.admission, "served_step", 3).execute()
    r.eval(
        "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('XADD', KEYS[2], '*', 'd', 'x')",
        2,
        keys.policy_version,
        keys.saw,
        "7",
    )
    server.kill()
    server.start()
    r = as_role(server.users, server.port, "learner")
    assert int(r.get(keys.learner_step)) == 5 and r.hget(keys.admission, "served_step") == b"3"
    assert int(r.get(keys.policy_version)) == 7 and r.xlen(keys.saw) == 1
    # still nobody can authenticate as the default user
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=server.port, username="default", password="").ping()


def test_the_written_files_start_a_redis_with_the_runs_users(tmp_path: Path, capsys) -> None:
    """What compose mounts (and a chart's existingSecret holds): redis-server with
    ``--aclfile users.acl``, which holds hashes, never a password, admits each role's URL
    file with its role's rights only and the admin's with every right; the default user is
    off; writing again keeps the passwords; ``ludic status`` reads through the admin's file."""
    port, d = free_port(), tmp_path / "secrets"
    argv = [str(d), "--run-id", "run-a", "--host", "127.0.0.1", "--port", str(port)]
    assert main(argv) == 0
    urls = {role: (d / secret_name(role, "url")).read_text() for role in (ADMIN, *ROLES)}
    acl = (d / ACL_FILE).read_text()
    for role in (ADMIN, *ROLES):
        assert (d / secret_name(role, "password")).read_text() not in acl
    assert main(argv) == 0 and urls["actor"] == (d / secret_name("actor", "url")).read_text()
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--dir", str(tmp_path), "--aclfile", str(d / ACL_FILE)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        admin = redis.Redis.from_url(urls[ADMIN])
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis died"
                time.sleep(0.05)
        assert admin.config_get("maxmemory")
        mine, other = t.Keys("run-a"), t.Keys("run-b")
        clients = []
        for role in ROLES:
            r = redis.Redis.from_url(urls[role], single_connection_client=True)
            clients.append(r)
            r.xadd(mine.requests, {"d": role.encode()})
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.get(other.policy_version)
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command("FLUSHALL")
        # each file's URL is its role's own user
        assert {c["user"] for c in admin.client_list()} >= {f"ludic-{r}" for r in ROLES}
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()
        capsys.readouterr()
        status_argv = ["--redis-url-file", str(d / secret_name(ADMIN, "url")), "--json"]
        assert status.main([*status_argv, "--run-id", "run-a"]) == 0
        assert '"length": 5' in capsys.readouterr().out  # the requests stream: one per role
    finally:
        proc.kill()
        proc.wait(10)


def test_an_empty_password_file_is_refused_naming_the_fix(tmp_path: Path, capsys) -> None:
    d = tmp_path / "secrets"
    assert main([str(d), "--run-id", "r", "--host", "redis"]) == 0
    (d / secret_name("learner", "password")).write_text("\n")
    assert main([str(d), "--run-id", "r", "--host", "redis"]) == 1
    assert "learner-password is empty: delete it" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[2]


def compose_redis(run_id: str) -> tuple[str, str, dict[str, str]]:
    """compose.yaml's redis command and healthcheck as compose runs them, and the paths they
    name -> the files' names in the written directory."""
    svc = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    (cmd,) = svc["command"]
    cmd = cmd.replace("${LUDIC_RUN_ID:-compose}", run_id).replace("${REDIS_MAXMEMORY:-2gb}", "1gb")
    cmd = cmd.replace("exec docker-entrypoint.sh redis-server", "exec redis-server --port 6379")
    probe = " ".join(svc["healthcheck"]["test"][1:]).replace("redis-cli", "redis-cli -p 6379")
    paths = {"/run/secrets/users.acl": ACL_FILE, "/run/secrets/admin-password": "admin-password"}
    return cmd.replace("$$", "$"), probe.replace("$$", "$"), paths


def chart_redis(run_id: str) -> tuple[str, str, dict[str, str]]:
    """The chart's Redis container (rendered by Helm's engine) the same way."""
    sys.path.insert(0, str(ROOT / "tests" / "deploy"))
    from deploy_support import containers, find, parse_docs, render

    docs = parse_docs(render({"runId": run_id}))
    (c,) = containers(find(docs, "StatefulSet", "redis"))
    (cmd,) = c["args"]
    probe = c["readinessProbe"]["exec"]["command"][-1]
    paths = {f"/etc/redis-users/{name}": name for name in (ACL_FILE, "admin-password")}
    return cmd, probe, paths


@pytest.mark.parametrize("deployment", [compose_redis, chart_redis])
def test_the_deployed_redis_command_and_probe_run_on_the_written_users(tmp_path, deployment):
    """compose's redis command and healthcheck, and the chart's container and probe, on a real
    redis-server with the files redis_acl writes: the probe (ludic-admin) passes, a role's URL
    reaches its run's keys only, nobody gets in without a user."""
    if not shutil.which("redis-cli"):
        pytest.skip("redis-cli not found (apt-get install redis-tools)")
    port, d = free_port(), tmp_path / "secrets"
    assert main([str(d), "--run-id", "run-a", "--host", "127.0.0.1", "--port", str(port)]) == 0
    cmd, probe, paths = deployment("run-a")
    for path, name in paths.items():
        cmd, probe = cmd.replace(path, str(d / name)), probe.replace(path, str(d / name))
    cmd = cmd.replace("--port 6379", f"--port {port} --save ''").replace("/data", str(tmp_path))
    cmd = cmd.replace("redis-server", redis_server_binary(), 1)
    proc = subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.DEVNULL)
    try:
        probe = probe.replace("-p 6379", f"-p {port}")
        deadline = time.monotonic() + 10
        while subprocess.run(["sh", "-c", probe]).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "redis died or unhealthy"
            time.sleep(0.1)
        actor = redis.Redis.from_url((d / secret_name("actor", "url")).read_text())
        actor.set(t.Keys("run-a").policy_version, 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            actor.set(t.Keys("run-b").policy_version, 1)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        proc.kill()
        proc.wait(10)
