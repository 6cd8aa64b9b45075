"""The vLLM general plugin bounds vLLM's idle spinning only under ``ludic inference``."""

from __future__ import annotations

import importlib.metadata

import pytest

from services.inference import vllm_plugin
from services.inference.engine import idle_wait_env
from services.inference.settings import InferenceSettings


class FakeCondition:
    """The attributes of vLLM's SpinCondition the plugin touches, recording each wait."""

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
    s = InferenceSettings(model=str(model))
    assert idle_wait_env(s, is_cpu=True) == {
        vllm_plugin.SPIN_ENV: "0.0",
        vllm_plugin.POLL_ENV: "20",
    }
    assert idle_wait_env(s, is_cpu=False) == {}
    s = InferenceSettings(model=str(model), engine_idle_spin_s=0.5, engine_idle_poll_ms=5)
    assert idle_wait_env(s, is_cpu=False) == {
        vllm_plugin.SPIN_ENV: "0.5",
        vllm_plugin.POLL_ENV: "5",
    }
