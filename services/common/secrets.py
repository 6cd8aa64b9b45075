"""Keep a service's secrets out of reach of other processes of its uid (no dependencies:
importable by any Python)."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import MutableMapping

PR_SET_DUMPABLE = 4


def keep_secrets_in() -> bool:
    """Make this process non-dumpable (Linux): its /proc files become root's, so processes
    of the same uid (agent code in the code_exec sandbox's plain mode) can no longer read
    its environment (the auth token, the Redis password) or attach to it. Returns whether
    it did (False elsewhere, or with ``LUDIC_DUMPABLE=1`` for a profiler run as the same
    user). The flag survives fork but not exec: the sandbox's programs are dumpable."""
    if not sys.platform.startswith("linux") or os.environ.get("LUDIC_DUMPABLE") == "1":
        return False
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


#: the environment variables that carry a secret of the run (the URL: its password)
SECRET_ENV = ("LUDIC_AUTH_TOKEN", "LUDIC_API_KEY", "LUDIC_REDIS_URL", "REDISCLI_AUTH")


def drop_secret_env(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove the run's secrets from this process's environment once its settings hold
    them: a child started afterwards (vLLM's engine processes, a sandboxed tool) inherits
    none of them. Returns the names removed."""
    env = os.environ if environ is None else environ
    gone = [name for name in SECRET_ENV if name in env]
    for name in gone:
        del env[name]
    return gone
