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
redis-server on stdin, never in argv)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

ROLES = ("actor", "credit", "learner", "feeder", "eval")
ADMIN = "ludic-admin"

#: every role's commands, applied left to right: the categories the services use, then the
#: dangerous and administrative commands taken back out of them
BASE_RULES = (
    "-@all +@connection +@read +@write +@stream +@hash +@string +@list +@set +@sortedset "
    "+@keyspace +@scripting +@transaction +@blocking -@admin -@dangerous -script|flush "
    "-script|kill"
)
EXTRA_RULES: Mapping[str, str] = {"feeder": "+info"}


def user_name(role: str) -> str:
    return f"ludic-{role}"


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

    def acl_config(self) -> str:
        """``user`` lines for redis.conf: default off, the admin, one user per role."""
        # default: off (nobody can authenticate as it) but with every permission, because
        # redis-server replays its append-only file as the default user and re-checks a
        # MULTI/EXEC's commands against it (Redis 7.0-7.4; redis/redis#14541): a default
        # without permissions silently drops every transaction and script effect on restart
        lines = [
            "user default off resetpass ~* &* +@all",
            f"user {ADMIN} on >{self.passwords[ADMIN]} ~* &* +@all",
        ]
        for role in ROLES:
            rules = role_rules(role, self.run_id)
            lines.append(f"user {user_name(role)} on >{self.passwords[role]} {rules}")
        return "\n".join(lines) + "\n"

    def url(self, role: str, host: str, port: int, db: int = 0) -> str:
        """``redis://user:password@host:port/db`` for ``role`` (or :data:`ADMIN`)."""
        user = ADMIN if role == ADMIN else user_name(role)
        pw = quote(self.passwords[role], safe="")
        return f"redis://{user}:{pw}@{host}:{port}/{db}"
