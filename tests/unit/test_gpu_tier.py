"""The GPU tier's gate (tests/gpu/gpus.py): `make test-gpu` and the tier's skips run where
torch is built with CUDA and sees a device, and say which of the two is missing elsewhere."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

GPUS = Path(__file__).resolve().parents[1] / "gpu" / "gpus.py"


def gpus() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpus_under_test", GPUS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cpu_build_of_torch_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    why = gpus().why_not()
    assert why is not None and "not built with CUDA" in why and "EXTRAS=gpu,dev" in why


def test_a_cuda_build_without_a_device_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = gpus().why_not()
    assert why is not None and why.startswith("no CUDA device") and "CUDA 12.8" in why


def test_a_cuda_build_with_a_device_runs_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert gpus().why_not() is None


def test_the_gate_exits_1_with_the_reason_on_this_machine() -> None:
    """What `make test-gpu` reads: exit 0 only where the tier can run."""
    p = subprocess.run([sys.executable, str(GPUS)], capture_output=True, text=True, timeout=120)
    assert p.returncode == (0 if gpus().why_not() is None else 1), p.stdout + p.stderr
    assert p.stdout.strip()
