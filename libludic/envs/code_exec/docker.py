"""DockerSandbox: run untrusted code in a throw-away container.

Used only when a Docker engine is reachable (``docker_available()``: ``docker info``
succeeds); ``select_sandbox`` falls back to ``SubprocessSandbox`` otherwise. One run is

    docker run --rm -i --pull never --name ludic-sbx-<hex> --network none --memory M --memory-swap M
      --pids-limit N --cpus 1 --read-only --tmpfs /tmp:rw,exec,size=16m --workdir /tmp
      --cap-drop ALL --security-opt no-new-privileges --user 65534:65534
      --ulimit cpu=S:H --ulimit fsize=F:F --ulimit core=0:0 --log-driver none
      -v <run dir>:/sandbox:ro <image> python -I /sandbox/main.py

with the test's stdin on ``-i``. The image is never pulled: it is the locally built
``ludic-sandbox:<python_version>`` (deploy/sandbox/Dockerfile; build it with
``ludic sandbox build [--base IMAGE]``) unless
``DockerSandboxConfig.base_image`` names another local image; a missing image raises an
error naming that command. The container enforces what the host-side subprocess
sandbox enforces with namespaces (no network, read-only root, pid and memory caps), plus a
cgroup memory limit instead of RLIMIT_AS. On wall-clock timeout the container is removed
with ``docker rm -f`` (killing the CLI alone would leave it running). Results are
classified as in ``sandbox.classify``; a container killed by the OOM killer exits 137 and
is reported as ``memory``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from libludic.envs.code_exec.config import DockerSandboxConfig
from libludic.envs.code_exec.sandbox import (
    STATUS_MEMORY,
    STATUS_SIGNAL,
    ExecResult,
    Sandbox,
    SubprocessSandbox,
    classify,
    pump,
)
from libludic.secret_env import child_env

_AVAILABLE: bool | None = None
_AVAILABLE_LOCK = threading.Lock()
_PRESENT: set[str] = set()  # images seen locally (``docker image inspect`` succeeded)

SANDBOX_DIR = Path(__file__).resolve().parents[3] / "deploy" / "sandbox"
DEFAULT_BASE = "python:{version}-slim"


def sandbox_image(config: DockerSandboxConfig) -> str:
    """The image a run uses: ``config.base_image`` or the local ``ludic-sandbox:<version>``."""
    return config.base_image or f"ludic-sandbox:{config.python_version}"


def build_command_for_image(
    tag: str,
    base: str,
    python_version: str,
    docker_bin: str = "docker",
    context: Path = SANDBOX_DIR,
) -> list[str]:
    """``docker build`` argv of the sandbox image ``tag`` FROM ``base``."""
    return [
        docker_bin, "build", "-t", tag, "--build-arg", f"BASE={base}",
        "--build-arg", f"PYTHON_VERSION={python_version}", str(context),
    ]  # fmt: skip


def build_image(
    config: DockerSandboxConfig | None = None, base: str | None = None, docker_bin: str = "docker"
) -> str:
    """Build the sandbox image of ``config`` locally FROM ``base`` (default: the official
    ``python:<version>-slim``, which the build may pull; pass a local image where Docker Hub
    is unreachable). Returns the tag."""
    cfg = config or DockerSandboxConfig()
    tag = sandbox_image(cfg)
    base = base or DEFAULT_BASE.format(version=cfg.python_version)
    argv = build_command_for_image(tag, base, cfg.python_version, docker_bin)
    r = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800, env=child_env()
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed (exit {r.returncode}):\n"
            f"{r.stdout.decode('utf-8', 'replace')[-3000:]}\nthe base image {base!r} must be "
            "present locally or pullable and provide `python` of that version"
        )
    _PRESENT.add(tag)
    return tag


def ensure_image(image: str, python_version: str, docker_bin: str = "docker") -> None:
    """Raise (naming the fix) unless ``image`` is present locally: runs never pull."""
    if image in _PRESENT:
        return
    r = subprocess.run(
        [docker_bin, "image", "inspect", "--format", "{{.Id}}", image],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=30,
        env=child_env(),
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"DockerSandbox image {image!r} is not present locally and is never pulled; build "
            f"it: `ludic sandbox build --python-version "
            f"{python_version} [--base LOCAL_PYTHON_IMAGE]` (or `docker build -t {image} "
            f"--build-arg BASE=... {SANDBOX_DIR}`), or set DockerSandboxConfig.base_image to a "
            "local image with python"
        )
    _PRESENT.add(image)


def docker_available(docker_bin: str = "docker", *, refresh: bool = False) -> bool:
    """True if ``docker info`` succeeds (a reachable engine, not just a CLI); cached."""
    global _AVAILABLE
    with _AVAILABLE_LOCK:
        if _AVAILABLE is None or refresh:
            exe = shutil.which(docker_bin)
            if exe is None:
                _AVAILABLE = False
            else:
                try:
                    r = subprocess.run(
                        [exe, "info", "--format", "{{.ServerVersion}}"],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        timeout=15,
                        env=child_env(),
                    )
                    _AVAILABLE = r.returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    _AVAILABLE = False
        return _AVAILABLE


@dataclass
class DockerSandbox:
    """Sandbox backend on a Docker engine (see the module docstring)."""

    config: DockerSandboxConfig = field(default_factory=DockerSandboxConfig)
    docker_bin: str = "docker"
    max_processes: int = 32  # --pids-limit
    max_output_bytes: int = 1 << 20  # per stream
    max_file_bytes: int = 1 << 20  # --ulimit fsize
    tmpfs_size: str = "16m"  # the writable cwd /tmp
    cpus: float = 1.0
    user: str = "65534:65534"  # nobody
    work_root: str | None = None

    def build_command(
        self, *, workdir: str, name: str, timeout_s: float, memory_limit: str | None = None
    ) -> list[str]:
        """The ``docker run`` argv of one run; ``memory_limit`` overrides the config's."""
        mem = memory_limit or self.config.memory_limit
        cpu = int(math.ceil(timeout_s)) + 1
        cmd = [self.docker_bin, "run", "--rm", "-i", "--pull", "never", "--name", name]
        if self.config.network_disabled:
            cmd += ["--network", "none"]
        cmd += [
            "--memory", mem,
            "--memory-swap", mem,
            "--pids-limit", str(self.max_processes),
            "--cpus", str(self.cpus),
            "--read-only",
            "--tmpfs", f"/tmp:rw,exec,size={self.tmpfs_size}",
            "--workdir", "/tmp",
            "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges",
            "--user", self.user,
            "--ulimit", f"cpu={cpu}:{cpu + 1}",
            "--ulimit", f"fsize={self.max_file_bytes}:{self.max_file_bytes}",
            "--ulimit", "core=0:0",
            "--log-driver", "none",
            "--env", "HOME=/tmp",
            "-v", f"{workdir}:/sandbox:ro",
            sandbox_image(self.config),
            "python", "-I", "/sandbox/main.py",
        ]  # fmt: skip
        return cmd

    def run(
        self, source: str, *, stdin: str = "", timeout_s: float = 5.0, memory_limit_mb: int = 256
    ) -> ExecResult:
        if not docker_available(self.docker_bin):
            raise RuntimeError(
                "DockerSandbox needs a reachable Docker engine (`docker info` failed); use "
                "select_sandbox(...) to fall back to SubprocessSandbox"
            )
        ensure_image(sandbox_image(self.config), self.config.python_version, self.docker_bin)
        # The config's memory_limit is the container's; the per-call limit (from
        # CodeExecConfig.memory_limit_mb) wins when it is smaller.
        mem = self.config.memory_limit
        if memory_limit_mb * 1024 * 1024 < _docker_bytes(mem):
            mem = f"{memory_limit_mb}m"
        name = f"ludic-sbx-{uuid.uuid4().hex[:16]}"
        workdir = tempfile.mkdtemp(prefix="ludic-docker-", dir=self.work_root)
        proc: subprocess.Popen[bytes] | None = None
        t0 = time.monotonic()
        try:
            os.chmod(workdir, 0o755)
            main = os.path.join(workdir, "main.py")
            with open(main, "w", encoding="utf-8") as f:
                f.write(source)
            os.chmod(main, 0o644)
            argv = self.build_command(
                workdir=workdir, name=name, timeout_s=timeout_s, memory_limit=mem
            )
            with tempfile.TemporaryFile() as fin:
                fin.write(stdin.encode("utf-8"))
                fin.seek(0)
                # the docker CLI needs none of the host's secrets (and the container
                # inherits none of its variables: the one --env gives HOME a value)
                proc = subprocess.Popen(
                    argv,
                    stdin=fin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=child_env(),
                )
            # Container start-up is not the code's time: allow a fixed 10 s on top.
            out, err, stop = pump(
                proc, deadline=t0 + timeout_s + 10.0, max_output_bytes=self.max_output_bytes
            )
            if stop is not None:
                self._remove(name)
            rc = proc.wait()
            stderr = err[: self.max_output_bytes].decode("utf-8", errors="replace")
            status, detail = classify(
                returncode=None if stop else rc,
                stop=stop,
                stderr=stderr,
                signal_from_exit_code=True,
            )
            if status == STATUS_SIGNAL and rc == 137:
                status, detail = STATUS_MEMORY, "container killed (SIGKILL, likely OOM)"
            return ExecResult(
                status=status,
                returncode=rc,
                stdout=out[: self.max_output_bytes].decode("utf-8", errors="replace"),
                stderr=stderr,
                duration_s=time.monotonic() - t0,
                detail=detail,
            )
        finally:
            if proc is not None:
                if proc.poll() is None:
                    self._remove(name)
                    proc.kill()
                proc.wait()
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def _remove(self, name: str) -> None:
        try:
            subprocess.run(
                [self.docker_bin, "rm", "-f", name],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=30,
                check=False,
                env=child_env(),
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"`docker rm -f {name}` did not finish in 30 s; the container may still run"
            ) from e


def _docker_bytes(size: str) -> int:
    """Docker memory syntax to bytes: ``"256m"`` -> 268435456."""
    units = {"b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
    s = size.strip().lower()
    if s[-1] in units:
        return int(s[:-1]) * units[s[-1]]
    return int(s)


def select_sandbox(docker: DockerSandboxConfig | None = None) -> Sandbox:
    """``DockerSandbox(docker)`` when a config is given and an engine is reachable, else a
    ``SubprocessSandbox`` (whose ``describe()`` says what it enforces here)."""
    if docker is not None and docker_available():
        return DockerSandbox(config=docker)
    return SubprocessSandbox()


def main(argv: list[str] | None = None) -> int:
    """``ludic sandbox build [--base IMAGE] [--python-version V]`` (services/cli.py)."""
    p = argparse.ArgumentParser(prog="ludic sandbox")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the DockerSandbox image locally (deploy/sandbox)")
    b.add_argument("--base", default=None, help="base image with python (default python:<v>-slim)")
    b.add_argument("--python-version", default="3.11")
    a = p.parse_args(argv)
    print(build_image(DockerSandboxConfig(python_version=a.python_version), a.base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
