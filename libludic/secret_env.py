"""Which environment variables carry a secret, and the environment a child process gets
without them.

A variable carries a secret when it is one of :data:`SECRET_ENV` (ludic's own: the weight
routes' token, the generation API key, the Redis URL with its password, the password
``redis-cli`` reads) or when its name ends in one of :data:`SECRET_SUFFIXES` (``HF_TOKEN``,
``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``DB_PASSWORD``, ...). A ``*_FILE`` variable
(``LUDIC_REDIS_URL_FILE``) names a file and carries no secret: it is how a child that needs
a secret gets one.

:func:`child_env` is what a process passes as ``env=`` where it starts a child that needs
none of them (``docker`` for the code sandbox, ``ludic up``'s services); ``keep`` names the
ones a given child does need.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

#: ludic's own secret-bearing variables (the Redis URL: its password)
SECRET_ENV = (
    "LUDIC_AUTH_TOKEN",
    "LUDIC_API_KEY",
    "LUDIC_REDIS_URL",
    "REDISCLI_AUTH",
    "REDIS_PASSWORD",
)
#: a variable whose name ends in one of these (or is one, without the underscore) is secret
SECRET_SUFFIXES = (
    "_TOKEN",
    "_PASSWORD",
    "_PASSWD",
    "_SECRET",
    "_API_KEY",
    "_ACCESS_KEY",
    "_SECRET_KEY",
    "_CREDENTIALS",
)


def is_secret_name(name: str) -> bool:
    """Whether the variable ``name`` carries a secret (module docstring)."""
    upper = name.upper()
    if upper in SECRET_ENV:
        return True
    return any(upper.endswith(s) or upper == s[1:] for s in SECRET_SUFFIXES)


def secret_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret-bearing variables set in ``environ`` (default ``os.environ``), sorted."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if is_secret_name(k))


def child_env(
    environ: Mapping[str, str] | None = None, *, keep: Iterable[str] = ()
) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) without its secret-bearing variables,
    except those ``keep`` names (a child that needs ``WANDB_API_KEY``)."""
    env = os.environ if environ is None else environ
    kept = set(keep)
    return {k: v for k, v in env.items() if k in kept or not is_secret_name(k)}
