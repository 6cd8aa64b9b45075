"""The code sandbox refuses to run untrusted code without its confinement, and its code sees
none of its host's secrets.

Where Landlock is missing (simulated: ``landlock.abi_version`` reports 0) the plain mode
cannot keep the code's writes in its run dir, nor, as the host's uid, the run's other
processes' environments private: it refuses, naming Landlock and the opt-out
(``allow`` / ``LUDIC_SANDBOX_ALLOW``), and so does the ``python`` tool. On this machine
(root, a kernel with Landlock) every mode keeps all three guarantees. The code's
environment is the sandbox's own few variables, whatever its host holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from libludic.agents import tools
from libludic.agents.tool_agent import ToolAgent, ToolUnavailable
from libludic.envs.code_exec import SubprocessSandbox, landlock
from libludic.envs.code_exec import env as env_mod
from libludic.envs.code_exec import sandbox as sandbox_mod
from tests.fakes import ScriptedClient

REPO = Path(__file__).resolve().parents[3]
FS = "filesystem_read_only_outside_cwd"
SECRET = "s3cret-7f01c2"


@pytest.fixture(scope="module")
def work_root() -> Iterator[str]:
    # traversable by the sandbox's fresh uid (pytest's tmp dirs are 0700)
    d = tempfile.mkdtemp(prefix="ludic-test-conf-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def no_landlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_mod.landlock, "abi_version", lambda: 0)


@pytest.fixture
def fresh_default_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    """``default_sandbox()`` built anew (it is one per process, read once)."""
    monkeypatch.setattr(env_mod, "_DEFAULT_SANDBOX", None)


def test_without_landlock_the_plain_mode_refuses_naming_it_and_the_opt_out(
    no_landlock: None, work_root: str
) -> None:
    sb = SubprocessSandbox(isolation="plain", work_root=work_root)
    with pytest.raises(RuntimeError, match=rf"cannot guarantee {FS}:.*no Landlock in this kernel"):
        sb.run("print('never runs')")
    with pytest.raises(RuntimeError, match=rf"LUDIC_SANDBOX_ALLOW={FS}$"):
        sb.describe()


def test_without_landlock_a_non_root_host_also_loses_environment_privacy(
    monkeypatch: pytest.MonkeyPatch, no_landlock: None, work_root: str
) -> None:
    """As the host's uid the code could read the environment of the run's other processes
    (vLLM's engine, torchrun's agent) even beside a non-dumpable host: both are named."""
    monkeypatch.setattr(sandbox_mod.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sandbox_mod, "host_dumpable", lambda: False)
    with pytest.raises(RuntimeError, match=rf"environment_private.*{FS}") as e:
        SubprocessSandbox(isolation="plain", work_root=work_root).describe()
    assert f"LUDIC_SANDBOX_ALLOW=environment_private,{FS}" in str(e.value)


def test_allowed_without_landlock_it_runs_and_says_so(no_landlock: None, work_root: str) -> None:
    sb = SubprocessSandbox(isolation="plain", work_root=work_root, allow=(FS,))
    d = sb.describe()
    assert d[FS] is False and d["allowed_without"] == [FS], d
    assert "writes outside the run dir possible (no Landlock in this kernel)" in str(d["note"])
    assert d["network_isolated"] and d["environment_private"]  # root: a fresh uid
    assert sb.run("print(6 * 7)").stdout == "42\n"


def test_the_python_tool_refuses_loudly_and_runs_once_allowed(
    monkeypatch: pytest.MonkeyPatch, no_landlock: None, fresh_default_sandbox: None
) -> None:
    """The refusal leaves the episode (``ToolUnavailable`` through ``run_tool``), never a
    tool message the model trains on; ``LUDIC_SANDBOX_ALLOW`` is the opt-out."""
    monkeypatch.setenv("LUDIC_SANDBOX_ALLOW", "")
    monkeypatch.setattr(
        env_mod,
        "SubprocessSandbox",
        lambda allow: SubprocessSandbox(isolation="plain", allow=allow),
    )
    agent = ToolAgent(client=ScriptedClient([]), tools=[tools.python])
    with pytest.raises(ToolUnavailable, match=rf"python tool cannot run:.*{FS}"):
        agent.run_tool("python", {"code": "print(1)"})
    monkeypatch.setattr(env_mod, "_DEFAULT_SANDBOX", None)
    monkeypatch.setenv("LUDIC_SANDBOX_ALLOW", FS)
    assert agent.run_tool("python", {"code": "print(6 * 7)"}).startswith("status: ok\nstdout:\n42")


@pytest.mark.parametrize("isolation", ["auto", "plain"])
def test_this_machine_keeps_every_guarantee(isolation: str, work_root: str) -> None:
    assert landlock.abi_version() >= 1, "the kernel has no Landlock (Linux >= 5.13 with it on)"
    d = SubprocessSandbox(isolation=isolation, work_root=work_root).describe()
    assert all(d[g] for g in sandbox_mod.GUARANTEES), d
    assert d["allowed_without"] == [], d


ENV_DUMP = "import json, os\nprint(json.dumps(dict(os.environ)))"


@pytest.mark.parametrize("isolation", ["auto", "plain"])
def test_the_code_sees_none_of_its_hosts_environment(
    isolation: str, monkeypatch: pytest.MonkeyPatch, work_root: str
) -> None:
    for name in ("LUDIC_AUTH_TOKEN", "LUDIC_REDIS_URL", "HF_TOKEN", "MY_SETTING"):
        monkeypatch.setenv(name, SECRET)
    res = SubprocessSandbox(isolation=isolation, work_root=work_root).run(ENV_DUMP)
    assert res.ok, res
    env = json.loads(res.stdout)
    assert SECRET not in res.stdout
    # the sandbox's own; PWD and OLDPWD: the namespace mode's set-up shell cd-ing to the run dir
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "PWD", "OLDPWD"}, env
    assert env["HOME"] == env["TMPDIR"] and env["HOME"].startswith(work_root), env


# The host, as an unprivileged uid: a sibling process of that uid holds a secret (vLLM's
# engine, torchrun's agent); the host makes itself non-dumpable, as a service does, and its
# sandboxed code tries the sibling's environment. argv: "landlock" or "none", the secret, the
# guarantee to allow without Landlock.
HOST = """
import ctypes, json, subprocess, sys, time
from libludic.envs.code_exec import SubprocessSandbox, landlock
if sys.argv[1] == "none":
    landlock.abi_version = lambda: 0
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
sibling = subprocess.Popen(["/bin/sleep", "60"], env={"LUDIC_AUTH_TOKEN": sys.argv[2]})
try:
    allow = () if sys.argv[1] == "landlock" else ("environment_private", sys.argv[3])
    sb = SubprocessSandbox(isolation="plain", allow=allow)
    d = sb.describe()
    code = f"print(open('/proc/{sibling.pid}/environ', 'rb').read())"
    r = sb.run(code, timeout_s=10)
    print(json.dumps({"private": d["environment_private"], "out": r.stdout + r.stderr}))
finally:
    sibling.kill()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the host as an unprivileged uid: needs root")
def test_a_non_root_host_keeps_its_siblings_environment_private_only_with_landlock() -> None:
    def host(mode: str) -> dict[str, object]:
        py = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
        out = subprocess.run(
            [py, "-c", HOST, mode, SECRET, FS],
            capture_output=True,
            text=True,
            timeout=120,
            user=65534,
            group=65534,
            extra_groups=[],
            cwd="/",
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0, out.stderr
        got: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        return got

    confined = host("landlock")
    assert confined["private"] is True and "PermissionError" in str(confined["out"]), confined
    assert SECRET not in str(confined["out"])
    # the hole the refusal guards: without Landlock the same code reads the sibling's secret
    open_ = host("none")
    assert open_["private"] is False and SECRET in str(open_["out"]), open_
