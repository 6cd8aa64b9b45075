"""Code-execution environment: the agent writes Python, sandboxed tests give the reward.

``CodeExecEnv`` (env.py) scores answers with a ``Sandbox``: ``SubprocessSandbox``
(sandbox.py, namespaces + rlimits + a fresh uid when the host is root) or ``DockerSandbox``
(docker.py, when a Docker engine is reachable; ``select_sandbox`` picks).
"""

from libludic.envs.code_exec.config import CodeExecConfig, DockerSandboxConfig
from libludic.envs.code_exec.docker import DockerSandbox, docker_available, select_sandbox
from libludic.envs.code_exec.env import (
    CodeExecEnv,
    CodeProblem,
    CodeTest,
    TestResult,
    extract_code,
    load_problems,
    normalise_output,
    run_tests,
    score,
)
from libludic.envs.code_exec.sandbox import ExecResult, Sandbox, SubprocessSandbox

__all__ = [
    "CodeExecConfig",
    "CodeExecEnv",
    "CodeProblem",
    "CodeTest",
    "DockerSandbox",
    "DockerSandboxConfig",
    "ExecResult",
    "Sandbox",
    "SubprocessSandbox",
    "TestResult",
    "docker_available",
    "extract_code",
    "load_problems",
    "normalise_output",
    "run_tests",
    "score",
    "select_sandbox",
]
