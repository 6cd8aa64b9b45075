"""Per-role Redis users (services/common/redis_acl.py) on a real redis-server: a role's user
reaches its run's keys with the commands the services use, and gets NOPERM on the
administrative and dangerous commands and on another run's keys; the default user is off."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from libludic import transport as t
from services.common.redis_acl import ADMIN, ROLES, RunUsers, key_pattern
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
