"""Keep a service's secrets out of reach of other processes of its uid (no dependencies
beyond the standard library and ``libludic.secret_env``: importable by any Python with the
repository on its path)."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import MutableMapping

from libludic.secret_env import SECRET_ENV, secret_names

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


def drop_secret_env(
    environ: MutableMapping[str, str] | None = None, *, every: bool = False
) -> list[str]:
    """Remove the run's secrets (``libludic.secret_env.SECRET_ENV``) from this process's
    environment once its settings hold them: a child started afterwards (vLLM's engine
    processes, a sandboxed tool) inherits none of them. ``every``: also every other
    secret-bearing variable (``is_secret_name``: ``HF_TOKEN``, ``WANDB_API_KEY``), for a
    service that needs none itself and whose children cannot be given an ``env=``
    (inference: vLLM spawns its engine). Returns the names removed."""
    env = os.environ if environ is None else environ
    gone = secret_names(env) if every else [name for name in SECRET_ENV if name in env]
    for name in gone:
        del env[name]
    return gone
