"""A service's secrets stay in: code running as the service's uid (the code_exec sandbox's
plain mode runs agent code as the actor's uid when the actor is not root) cannot read the
service's /proc/<pid>/environ once the service made itself non-dumpable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECRET = "tok-3c41d9"

# the "service": holds a secret in its environment, hardens itself (or not), then runs the
# "agent code" as a child of the same uid, which tries to read the service's environment
# through /proc/<parent>/environ
HOST = """
import subprocess, sys
from services.common.secrets import keep_secrets_in
if sys.argv[1] == "harden":
    assert keep_secrets_in()
agent = "import os\\ntry:\\n    print(open(f'/proc/{os.getppid()}/environ', 'rb').read().decode(errors='replace'))\\nexcept OSError as e:\\n    print('refused', type(e).__name__)"
print(subprocess.run([sys.executable, "-c", agent], capture_output=True, text=True).stdout)
"""


def run_host(mode: str) -> str:
    py = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    out = subprocess.run(
        [py, "-c", HOST, mode],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
        env={"PYTHONPATH": str(REPO), "LUDIC_AUTH_TOKEN": SECRET, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(
    os.geteuid() != 0 or not sys.platform.startswith("linux"),
    reason="runs the service as an unprivileged uid: needs root",
)
def test_code_of_the_same_uid_cannot_read_a_hardened_services_environment() -> None:
    assert SECRET in run_host("plain")  # the hole: same uid, dumpable service
    got = run_host("harden")
    assert SECRET not in got and "refused PermissionError" in got


def test_ludic_dumpable_keeps_a_service_attachable(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.common.secrets import keep_secrets_in

    monkeypatch.setenv("LUDIC_DUMPABLE", "1")
    assert keep_secrets_in() is False
