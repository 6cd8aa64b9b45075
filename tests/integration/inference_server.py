"""A real ``ludic inference`` subprocess on a free port, for integration tests and the bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


class InferenceServer:
    def __init__(
        self,
        model_dir: Path,
        port: int,
        token: str | None,
        log_path: Path,
        extra_args: list[str] | None = None,
        compiled: bool = False,
    ):
        """``compiled``: serve as shipped (torch.compile, ~10 s more start-up); tests of
        the HTTP and weight-update behaviour run eagerly, tests of served logprobs compiled."""
        self.model_dir = model_dir
        self.compiled = compiled
        self.port = port
        self.token = token
        self.log_path = log_path
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 240.0) -> None:
        env: dict[str, str] = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.pop("LUDIC_AUTH_TOKEN", None)
        if self.token:
            env["LUDIC_AUTH_TOKEN"] = self.token
        cmd = [
            sys.executable, "-m", "services.inference.main",
            "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "512",
            *([] if self.compiled else ["--enforce-eager"]), *self.extra_args,
        ]  # fmt: skip
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"inference server exited {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"inference server not healthy after {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 60 s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
