"""The vLLM general plugin bounds vLLM's idle spinning only under ``ludic inference``."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.inference import vllm_plugin
from services.inference.settings import InferenceSettings, SettingsError
from services.inference.worker import cpu_linear_env, idle_wait_env


class FakeCondition:
    """The attributes of vLLM's SpinCondition the plugin touches, recording each wait (kept
    here, not in tests/fakes.py: only the plugin's tests stand in for vLLM's queue)."""

    def __init__(self, is_reader: bool = True):
        self.is_reader = is_reader
        self.busy_loop_s = 1.0
        self.waits: list[tuple[float, int | None]] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.waits.append((self.busy_loop_s, timeout_ms))


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[FakeCondition]:
    from vllm.distributed.device_communicators import shm_broadcast

    cls = type("SpinCondition", (FakeCondition,), {})
    monkeypatch.setattr(shm_broadcast, "SpinCondition", cls)
    return cls


def test_entry_point_is_registered_for_vllm() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {ep.value for ep in eps if ep.name == "ludic"} == {
        "services.inference.vllm_plugin:register"
    }


def test_without_the_environment_nothing_is_patched(
    fake_vllm: type[FakeCondition], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(vllm_plugin.SPIN_ENV, raising=False)
    vllm_plugin.register()
    c = fake_vllm()
    c.wait(5000)
    assert c.waits == [(1.0, 5000)]  # vLLM's own 1 s spin and 5 s recheck


def test_readers_stop_spinning_and_sleep_at_most_the_cap(
    fake_vllm: type[FakeCondition], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = fake_vllm()  # a queue built before vLLM loaded the plugin
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "0")
    monkeypatch.setenv(vllm_plugin.POLL_ENV, "20")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once: no double wrapping
    after, writer = fake_vllm(), fake_vllm(is_reader=False)
    before.wait(5000)
    after.wait(None)
    after.wait(7)
    writer.wait(5000)
    assert before.waits == [(0.0, 20)]
    assert after.waits == [(0.0, 20), (0.0, 7)]  # a shorter deadline is kept
    assert writer.waits == [(1.0, 5000)]  # only readers wait


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "fast")
    with pytest.raises(ValueError, match="LUDIC_VLLM_BUSY_LOOP_S='fast'"):
        vllm_plugin.settings()
    monkeypatch.setenv(vllm_plugin.SPIN_ENV, "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        vllm_plugin.settings()


def test_inference_sets_no_spin_on_cpu_and_leaves_gpus_alone(tmp_path: object) -> None:
    from libludic.models.tiny import init_model

    model = init_model(tmp_path / "m", size="tiny")  # type: ignore[operator]
    s = InferenceSettings(model_dir=str(model))
    assert idle_wait_env(s, is_cpu=True) == {
        vllm_plugin.SPIN_ENV: "0.0",
        vllm_plugin.POLL_ENV: "20",
    }
    assert idle_wait_env(s, is_cpu=False) == {}
    s = InferenceSettings(model_dir=str(model), engine_idle_spin_s=0.5, engine_idle_poll_ms=5)
    assert idle_wait_env(s, is_cpu=False) == {
        vllm_plugin.SPIN_ENV: "0.5",
        vllm_plugin.POLL_ENV: "5",
    }


@pytest.fixture
def vllm_dispatch(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """vLLM's CPU GEMM dispatch replaced by a recorder (restored after the test)."""
    from vllm.model_executor.layers import utils

    calls: list[tuple[str, bool]] = []

    def original(layer: torch.nn.Module, remove_weight: bool) -> None:
        calls.append((type(layer).__name__, remove_weight))
        layer.cpu_linear = "packed"  # type: ignore[assignment]

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", original)
    return calls


def test_plain_linear_keeps_2d_weights_and_leaves_other_layers_to_vllm(
    monkeypatch: pytest.MonkeyPatch, vllm_dispatch: list[tuple[str, bool]]
) -> None:
    from vllm.model_executor.layers import utils

    monkeypatch.delenv(vllm_plugin.SPIN_ENV, raising=False)
    monkeypatch.setenv(vllm_plugin.PLAIN_LINEAR_ENV, "1")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may call it twice: patched once
    assert utils.dispatch_cpu_unquantized_gemm.__wrapped__.__name__ == "original"

    linear = torch.nn.Linear(4, 3)
    weight = linear.weight
    utils.dispatch_cpu_unquantized_gemm(linear, True)
    assert vllm_plugin.uses_plain_linear(linear) and linear.weight is weight  # kept
    # small integers: with the weights of ones below, every sum is exact in any order
    x = torch.randint(-4, 5, (2, 4)).float()
    torch.testing.assert_close(linear.cpu_linear(x, linear.weight, linear.bias), linear(x))
    with torch.no_grad():
        linear.weight.copy_(torch.ones(3, 4))  # an update: the next call multiplies by it
    assert torch.equal(
        linear.cpu_linear(x, linear.weight, None), x.sum(-1, keepdim=True).expand(2, 3)
    )

    conv = torch.nn.Module()
    conv.weight = torch.nn.Parameter(torch.zeros(8, 1, 4))  # 3-D: vLLM's own dispatch
    utils.dispatch_cpu_unquantized_gemm(conv, True)
    assert vllm_dispatch == [("Module", True)] and not vllm_plugin.uses_plain_linear(conv)


def test_without_the_plain_linear_environment_vllm_packs_as_usual(
    monkeypatch: pytest.MonkeyPatch, vllm_dispatch: list[tuple[str, bool]]
) -> None:
    from vllm.model_executor.layers import utils

    monkeypatch.setenv(vllm_plugin.PLAIN_LINEAR_ENV, "0")
    vllm_plugin.register()
    utils.dispatch_cpu_unquantized_gemm(torch.nn.Linear(4, 3), True)
    assert vllm_dispatch == [("Linear", True)]


def test_cpu_linear_is_plain_for_float32_unless_chosen_and_absent_on_gpus(
    tiny_model_dir: Path,
) -> None:
    def env(**kw: str) -> dict[str, str]:
        return cpu_linear_env(InferenceSettings(model_dir=str(tiny_model_dir), **kw), is_cpu=True)

    on, off = {vllm_plugin.PLAIN_LINEAR_ENV: "1"}, {vllm_plugin.PLAIN_LINEAR_ENV: "0"}
    assert env(dtype="float32") == on
    assert env(dtype="bfloat16") == off  # vLLM's packed kernels where they matter most
    assert env(dtype="bfloat16", cpu_linear="plain") == on
    assert env(dtype="float32", cpu_linear="packed") == off
    s = InferenceSettings(model_dir=str(tiny_model_dir), dtype="float32")
    assert cpu_linear_env(s, is_cpu=False) == {}
    with pytest.raises(SettingsError, match="cpu_linear 'onednn' is not one of"):
        InferenceSettings(model_dir=str(tiny_model_dir), cpu_linear="onednn")


def test_an_update_is_a_copy_only_when_nothing_needs_post_processing() -> None:
    from services.inference.worker_ext import copy_reload_applies

    def config(quantization: str | None = None, cache_dtype: str = "auto") -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(quantization=quantization),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        )

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert not copy_reload_applies(model, config())  # no CPU kernels at all (a GPU worker)
    for layer in model:
        layer.cpu_linear = vllm_plugin.plain_linear  # type: ignore[assignment]
    assert copy_reload_applies(model, config())
    assert not copy_reload_applies(model, config(quantization="fp8"))
    assert not copy_reload_applies(model, config(cache_dtype="fp8"))
    model[1].cpu_linear = lambda x, w, b: x  # type: ignore[assignment]  # a packed layer
    assert not copy_reload_applies(model, config())
