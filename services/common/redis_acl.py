"""Redis users per role: each service authenticates as its own user, which may touch only its
run's keys (``ludic:{<run_id>}:*``) with the commands the services use, never ``@admin`` or
``@dangerous`` (FLUSHALL, CONFIG, REPLICAOF, SHUTDOWN, ACL, DEBUG, KEYS, ...).

What every role may run: the data types of the run's streams, leases, counters and markers,
the project's Lua scripts (Redis 7 checks each key a script touches against the caller's
user), transactions and blocking reads. The feeder also reads ``INFO`` (memory and keyspace:
its footprint gauges, services/common/lifecycle.py). The ``default`` user is off (it keeps
every permission only for redis-server's replay of its own append-only file); an admin
user (every key and command) is the launcher's own: ``ludic status``, the live view and
the run's accounting read through it, and no service gets its password.

``acl_config`` renders the ``user`` lines of a redis.conf (``ludic up`` hands them to its
redis-server on stdin, never in argv). ``python -m services.common.redis_acl DIR --run-id RUN
--host HOST`` writes the same users for a Redis of compose or a cluster into DIR: one
``<role>-password`` and ``<role>-url`` file per role and the admin, and ``users.acl`` (the
lines with SHA-256 hashes instead of passwords) for redis-server's ``--aclfile``; the
passwords already in DIR are kept. A Helm template cannot call Python, so the chart renders the
same lines itself (helm/ludic/templates/_helpers.tpl): tests/deploy/test_deploy_redis_users.py
fails when they differ from ``acl_config``."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

ROLES = ("actor", "credit", "learner", "feeder", "eval")
ADMIN = "ludic-admin"

#: every role's commands, applied left to right: the categories the services use, then the
#: dangerous and administrative commands taken back out of them (the chart's ludic.redisRoleRules
#: repeats them: change both)
BASE_RULES = (
    "-@all +@connection +@read +@write +@stream +@hash +@string +@list +@set +@sortedset "
    "+@keyspace +@scripting +@transaction +@blocking -@admin -@dangerous -script|flush "
    "-script|kill"
)
EXTRA_RULES: Mapping[str, str] = {"feeder": "+info"}
#: the file (and Secret key) of the ACL lines, next to the per-role files of ``secret_name``
ACL_FILE = "users.acl"


def user_name(role: str) -> str:
    return f"ludic-{role}"


def secret_name(role: str, what: str) -> str:
    """File (and Secret key) name of ``role``'s ``password`` or ``url``: ``actor-url``,
    ``admin-password`` (for :data:`ADMIN`)."""
    return f"{'admin' if role == ADMIN else role}-{what}"


def key_pattern(run_id: str) -> str:
    """The run's key pattern, glob characters of ``run_id`` escaped."""
    return "ludic:{" + re.sub(r"([*?\[\]\\])", r"\\\1", run_id) + "}:*"


def role_rules(role: str, run_id: str) -> str:
    """The ACL rules of ``role``'s user (without its password)."""
    if role not in ROLES:
        raise ValueError(f"unknown Redis role {role!r}; one of {list(ROLES)}")
    extra = EXTRA_RULES.get(role, "")
    return f"resetkeys ~{key_pattern(run_id)} resetchannels {BASE_RULES} {extra}".strip()


@dataclass
class RunUsers:
    """One password per role and the admin's, generated for one run."""

    run_id: str
    passwords: dict[str, str] = field(
        default_factory=lambda: {r: secrets.token_hex(24) for r in (*ROLES, ADMIN)}
    )

    def acl_config(self, hashed: bool = False) -> str:
        """``user`` lines for redis.conf (or an ACL file): default off, the admin, one user per
        role; each password as ``>password``, or with ``hashed`` as ``#<sha256 hex>`` (a file
        that holds no password)."""

        def pw(role: str) -> str:
            p = self.passwords[role]
            return f"#{hashlib.sha256(p.encode()).hexdigest()}" if hashed else f">{p}"

        # default: off (nobody can authenticate as it) but with every permission, because
        # redis-server replays its append-only file as the default user and re-checks a
        # MULTI/EXEC's commands against it (Redis 7.0-7.4; redis/redis#14541): a default
        # without permissions silently drops every transaction and script effect on restart
        lines = [
            "user default off resetpass ~* &* +@all",
            f"user {ADMIN} on {pw(ADMIN)} ~* &* +@all",
        ]
        for role in ROLES:
            rules = role_rules(role, self.run_id)
            lines.append(f"user {user_name(role)} on {pw(role)} {rules}")
        return "\n".join(lines) + "\n"

    def url(self, role: str, host: str, port: int, db: int = 0, scheme: str = "redis") -> str:
        """``redis://user:password@host:port/db`` for ``role`` (or :data:`ADMIN`)."""
        user = ADMIN if role == ADMIN else user_name(role)
        pw = quote(self.passwords[role], safe="")
        return f"{scheme}://{user}:{pw}@{host}:{port}/{db}"


def write_secrets(
    directory: Path, run_id: str, host: str, port: int = 6379, db: int = 0, tls: bool = False
) -> RunUsers:
    """The run's users as files in ``directory`` (made ``0700``): ``<role>-password`` (kept
    when present, else made), ``<role>-url`` (``redis[s]://ludic-<role>:...@host:port/db``)
    and :data:`ACL_FILE`, for every role and the admin. The files are ``0644``: compose
    bind-mounts them into containers whose uid is not the host user's, and the directory
    keeps the host's other users out. Raises ``ValueError`` naming an empty password file."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    users = RunUsers(run_id)
    for role in (ADMIN, *ROLES):
        path = directory / secret_name(role, "password")
        if path.exists():
            users.passwords[role] = path.read_text().strip()
            if not users.passwords[role]:
                raise ValueError(f"{path} is empty: delete it to have a password made")
    files = {ACL_FILE: users.acl_config(hashed=True)}
    for role in (ADMIN, *ROLES):
        files[secret_name(role, "password")] = users.passwords[role]
        files[secret_name(role, "url")] = users.url(
            role, host, port, db, "rediss" if tls else "redis"
        )
    for name, text in files.items():
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        (directory / name).chmod(0o644)
    return users


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.common.redis_acl",
        description="Write a run's Redis users into DIR: <role>-password and <role>-url per "
        "role and the admin, and users.acl for redis-server --aclfile (compose mounts DIR; "
        "`kubectl create secret generic NAME --from-file=DIR` makes the chart's existingSecret)",
    )
    p.add_argument("dir", type=Path, help="where the files go (e.g. deploy/compose/secrets)")
    p.add_argument("--run-id", required=True, help="LUDIC_RUN_ID of the run (its key namespace)")
    p.add_argument("--host", required=True, help="the Redis host the services reach")
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--db", type=int, default=0)
    p.add_argument("--tls", action="store_true", help="rediss:// URLs")
    a = p.parse_args(argv)
    try:
        write_secrets(a.dir, a.run_id, a.host, a.port, a.db, a.tls)
    except (OSError, ValueError) as e:
        print(f"redis_acl: {e}", file=sys.stderr)
        return 1
    print(f"{a.dir}: Redis users of run {a.run_id!r} at {a.host}:{a.port}/{a.db}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
