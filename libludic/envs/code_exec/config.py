"""Configuration of the code-execution environment and its Docker backend.

Names and defaults follow the configuration spec (``CodeExecConfig``,
``DockerSandboxConfig``); both validate at construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MEMORY_RE = re.compile(r"^[1-9][0-9]*[bkmg]?$", re.IGNORECASE)
_PY_VERSION_RE = re.compile(r"^3\.[0-9]+(\.[0-9]+)?$")


@dataclass(frozen=True)
class CodeExecConfig:
    """How the tests of one problem are run and scored.

    reward = 1.0 if every run test passes else 0.0; with ``partial_credit``
    reward = passed / n_selected, where n_selected = min(len(tests), max_tests) counts the
    tests skipped after a failure (``stop_on_first_failure``) as failed.
    """

    timeout_per_test_s: float = 5.0  # wall clock per test; CPU rlimit is derived from it
    memory_limit_mb: int = 256  # address-space limit of the test process
    max_tests: int | None = None  # run at most the first N tests (None: all)
    stop_on_first_failure: bool = True  # skip the remaining tests after a failure
    partial_credit: bool = False  # reward = pass fraction instead of all-or-nothing

    def __post_init__(self) -> None:
        if not self.timeout_per_test_s > 0:
            raise ValueError(
                f"CodeExecConfig.timeout_per_test_s={self.timeout_per_test_s} must be > 0 "
                f"seconds; use e.g. 5.0"
            )
        if self.memory_limit_mb < 16:
            raise ValueError(
                f"CodeExecConfig.memory_limit_mb={self.memory_limit_mb} is below 16 MB, too "
                f"small to start a Python interpreter; use >= 64"
            )
        if self.max_tests is not None and self.max_tests < 1:
            raise ValueError(
                f"CodeExecConfig.max_tests={self.max_tests} must be >= 1, or None for all tests"
            )


@dataclass(frozen=True)
class DockerSandboxConfig:
    """The container a ``DockerSandbox`` runs code in.

    ``base_image`` overrides the default ``python:{python_version}-slim``; ``memory_limit``
    uses Docker's syntax (``"256m"``, ``"1g"``) and also caps swap.
    """

    python_version: str = "3.11"
    base_image: str | None = None
    memory_limit: str = "256m"
    network_disabled: bool = True

    def __post_init__(self) -> None:
        if not _PY_VERSION_RE.match(self.python_version):
            raise ValueError(
                f"DockerSandboxConfig.python_version={self.python_version!r} is not a Python 3 "
                f"version like '3.11'"
            )
        if self.base_image is not None and (not self.base_image.strip() or " " in self.base_image):
            raise ValueError(
                f"DockerSandboxConfig.base_image={self.base_image!r} is not an image reference; "
                f"use e.g. 'python:3.11-slim' or None for the default"
            )
        if not _MEMORY_RE.match(self.memory_limit):
            raise ValueError(
                f"DockerSandboxConfig.memory_limit={self.memory_limit!r} is not a Docker memory "
                f"size; use e.g. '256m' or '1g'"
            )

    @property
    def image(self) -> str:
        return self.base_image or f"python:{self.python_version}-slim"
