"""How `ludic up` hands a service the secrets it needs: sealed in-memory files (memfd) it
reads at the ``/dev/fd/<n>`` path a ``*_FILE`` variable names, made anew at each start and
never inherited further; 0600 files of a private directory where no descriptor can reach
(services/common/secrets.py, services/launcher/supervisor.py)."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.secrets import FD_PATH, SecretFiles, keep_secret_fds_in, secret_fd
from services.launcher.supervisor import ServiceSpec, Supervisor

SECRET = "s3cret-5d2e91"


def test_a_secret_fd_reads_from_the_start_at_every_open_and_cannot_be_written() -> None:
    fd = secret_fd("ludic_auth_token_file", SECRET)
    try:
        path = f"{FD_PATH}{fd}"
        assert Path(path).read_text() == SECRET and Path(path).read_text() == SECRET
        with pytest.raises(PermissionError):
            Path(path).write_text("other")
        assert not os.get_inheritable(fd)  # only a child given it in pass_fds holds it
    finally:
        os.close(fd)


def test_keep_secret_fds_in_marks_the_handed_descriptors_close_on_exec() -> None:
    fd = secret_fd("x", SECRET)
    try:
        os.set_inheritable(fd, True)  # as a child that got it through pass_fds holds it
        env = {"LUDIC_API_KEY_FILE": f"{FD_PATH}{fd}", "LUDIC_OTHER_FILE": "/run/x"}
        assert keep_secret_fds_in(env) == [fd]
        assert not os.get_inheritable(fd)
        assert Path(f"{FD_PATH}{fd}").read_text() == SECRET  # still readable here
    finally:
        os.close(fd)


def test_secret_files_are_private_and_removed_on_close() -> None:
    files = SecretFiles(prefix="ludic-test-")
    try:
        path = files.write("learner-ludic_auth_token_file", SECRET)
        assert Path(path).read_text() == SECRET
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(files.dir).st_mode) == 0o700
        if os.path.isdir("/dev/shm"):
            assert files.dir.startswith("/dev/shm/")  # tmpfs: never on disk
        with pytest.raises(ValueError, match="plain file name"):
            files.write("../x", SECRET)
    finally:
        files.close()
    assert not os.path.exists(files.dir)


def test_a_spec_refuses_a_secret_as_a_value_in_its_env() -> None:
    with pytest.raises(ValueError, match=r"\['LUDIC_AUTH_TOKEN'\] as values.*secrets="):
        ServiceSpec("learner", ["true"], env={"LUDIC_AUTH_TOKEN": SECRET})


# the service: what it finds in its environment, and the secret read at its *_FILE path
SERVICE = """import os, sys
path = os.environ["LUDIC_AUTH_TOKEN_FILE"]
print(repr(dict(os.environ)))
print(open(path).read())
"""


def test_a_service_inherits_no_secret_and_reads_the_one_it_needs_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ludic up`'s environment holds secrets (ludic's, the user's); the service started
    from it holds none of them as a value, except the one its spec keeps, and reads its own
    token at ``/dev/fd/<n>``; nothing it could read names another secret file."""
    for name in ("LUDIC_AUTH_TOKEN", "LUDIC_REDIS_URL", "HF_TOKEN", "WANDB_API_KEY"):
        monkeypatch.setenv(name, SECRET)
    monkeypatch.setenv("LUDIC_REDIS_URL_FILE", "/run/secrets/ludic/redis-url")
    sup = Supervisor(tmp_path)
    spec = ServiceSpec(
        "learner",
        [sys.executable, "-c", SERVICE],
        env={"LUDIC_RUN_ID": "r1"},
        secrets={"LUDIC_AUTH_TOKEN_FILE": "the-run-token"},
        keep_env=("WANDB_API_KEY",),
    )
    sup.start(spec)
    assert sup.procs["learner"].wait(30) == 0
    env_line, token = (tmp_path / "logs" / "learner.log").read_text().splitlines()[:2]
    env = ast.literal_eval(env_line)
    assert token == "the-run-token"
    assert env["LUDIC_AUTH_TOKEN_FILE"].startswith(FD_PATH) and env["LUDIC_RUN_ID"] == "r1"
    assert env["WANDB_API_KEY"] == SECRET  # kept by the spec
    assert "LUDIC_REDIS_URL_FILE" not in env  # `ludic up` hands over its own, or none
    assert SECRET not in env_line.replace(f"'WANDB_API_KEY': '{SECRET}'", "")
    # this process closed its descriptor once the service had its own copy
    assert not [link for link in open_links() if "ludic_auth_token_file" in link]


def open_links() -> list[str]:
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{n}"))
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return out


# a service on the skeleton, handed its token as `ludic up` does; its child inherits every
# descriptor it may (close_fds=False), as a careless spawner would
SKELETON_SERVICE = """
import subprocess, sys
from dataclasses import dataclass, field
from services.common.settings import secret_from_file
from services.common.skeleton import service_main

@dataclass
class S:
    log_level: str = "INFO"
    auth_token_file: str | None = None

async def run(s, *, stop):
    token = secret_from_file(None, s.auth_token_file, "LUDIC_AUTH_TOKEN", "token")
    again = secret_from_file(None, s.auth_token_file, "LUDIC_AUTH_TOKEN", "token")
    probe = "import sys\\ntry:\\n    print(open(sys.argv[1]).read())\\nexcept OSError as e:\\n    print('closed', e.errno)"
    child = subprocess.run([sys.executable, "-c", probe, s.auth_token_file],
                           capture_output=True, text=True, close_fds=False)
    print(token, again, child.stdout.strip(), flush=True)

sys.exit(service_main("t", S, run, [], description="t"))
"""


def test_a_service_reads_its_handed_token_and_its_children_do_not_inherit_it() -> None:
    repo = Path(__file__).resolve().parents[2]
    fd = secret_fd("ludic_auth_token_file", SECRET)
    try:
        env = {"PATH": os.environ["PATH"], "LUDIC_AUTH_TOKEN_FILE": f"{FD_PATH}{fd}"}
        out = subprocess.run(
            [sys.executable, "-c", SKELETON_SERVICE],
            cwd=repo,
            env=env,
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(fd)
    assert out.returncode == 0, out.stderr
    token, again, child = out.stdout.strip().split(" ", 2)
    assert token == again == SECRET  # read twice: every open starts at the beginning
    assert child == "closed 2", child  # ENOENT: no such descriptor in the child
