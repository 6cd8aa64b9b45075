"""Keep a service's secrets out of reach of other processes of its uid (no dependencies
beyond the standard library and ``libludic.secret_env``: importable by any Python with the
repository on its path)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, MutableMapping

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


#: where a secret handed over as a file descriptor is read (``secret_fd``)
FD_PATH = "/dev/fd/"


def secret_fd(name: str, value: str) -> int:
    """A sealed in-memory file (``memfd``) holding ``value``, for a child that reads it at
    ``/dev/fd/<fd>`` (pass the fd with ``Popen(pass_fds=...)``, name that path in the
    child's ``*_FILE`` variable, then close it here). The value lives in no environment,
    no argv and no filesystem: only the child (and root) can open it, and a process of the
    same uid only through ``/proc/<child>/fd``, which a non-dumpable service and a Landlock
    domain both deny. Every open of the path reads it from the start; nothing can write it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, value.encode())
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def keep_secret_fds_in(environ: Mapping[str, str] | None = None) -> list[int]:
    """Mark the secret descriptors this process was handed (``*_FILE`` variables naming
    ``/dev/fd/<n>``) close-on-exec, once its settings are read: a program it starts (vLLM's
    engine, a sandboxed tool) does not inherit them; this process can still read the path
    again. Returns the descriptors."""
    env = os.environ if environ is None else environ
    fds = []
    for name, value in env.items():
        if name.endswith("_FILE") and value.startswith(FD_PATH) and value[len(FD_PATH) :].isdigit():
            fd = int(value[len(FD_PATH) :])
            try:
                os.set_inheritable(fd, False)
            except OSError:  # not open here (a path meant for another process)
                continue
            fds.append(fd)
    return fds


class SecretFiles:
    """Secrets handed to child processes as files on a filesystem, where a descriptor cannot
    reach the process that reads them (torchrun's ranks: its agent closes every inherited
    descriptor): each ``write(name, value)`` is a file of mode 0600 in one private directory
    (0700; on ``/dev/shm`` where it is writable, so never on disk) whose path the child
    reads from a ``*_FILE`` variable; ``close()`` removes them all. The value lives in no
    environment and no argv, but, unlike ``secret_fd``'s, any process of the same uid can
    read the file while it exists (the code_exec sandbox's plain mode as a non-root user)."""

    def __init__(self, prefix: str = "ludic-secrets-") -> None:
        shm = "/dev/shm"
        parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
        self.dir = tempfile.mkdtemp(prefix=prefix, dir=parent)  # mode 0700

    def write(self, name: str, value: str) -> str:
        """The path of a file holding ``value`` (rewritten when ``name`` exists)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"secret file name {name!r} must be a plain file name")
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        return path

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
