"""The ``ludic`` weight-transfer engine (services/inference/weight_transfer.py): its place in
vLLM's registry, the parsing of its init and update infos, and the collective plane end to
end without vLLM: the real sender (libludic/distributed/weight_sync.py) and the real app
(services/inference/app.py) around ``TensorEngine``, whose workers are real
``LudicTransferEngine``s over ``ServedModel``s, in one process over loopback gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from libludic.distributed.weight_sync import CollectiveWeightSender, WeightSyncError
from services.inference import vllm_plugin
from services.launcher.stack import free_port
from tests.fakes import ServedApp, ServedModel, TensorEngine, transfer_worker, worker_vllm_config

INIT = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "world_size": 3,
    "rank_offset": 1,
    "backend": "gloo",
    "timeout_s": 30.0,
}
META = {"names": ["a", "b"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 3], []]}


def test_register_puts_the_engine_in_vllms_registry_once() -> None:
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from services.inference.weight_transfer import LudicTransferEngine

    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins more than once per process: no error
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=vllm_plugin.TRANSFER_BACKEND),
        worker_vllm_config(0, 1),
        torch.device("cpu"),
        ServedModel({}),
    )
    assert type(engine) is LudicTransferEngine
    # the name LudicEngine.start passes in --weight-transfer-config
    assert vllm_plugin.TRANSFER_BACKEND == "ludic"


def test_init_info_parses_and_names_what_is_wrong() -> None:
    w = transfer_worker({}, 0, 2)
    info = w.parse_init_info(INIT)
    assert (info.master_port, info.world_size, info.rank_offset, info.backend) == (
        29500,
        3,
        1,
        "gloo",
    )
    for change, match in [
        ({"backend": "mpi"}, "backend 'mpi'"),
        ({"rank_offset": 0}, "the learner is 0"),
        ({"world_size": 1}, "leaves no rank"),
        ({"master_port": 0}, "outside 1..65535"),
        ({"master_address": ""}, "empty"),
        ({"timeout_s": 0}, "must be > 0"),
        ({"extra": 1}, "Invalid init_info"),
    ]:
        with pytest.raises(ValueError, match=match):
            w.parse_init_info({**INIT, **change})
    with pytest.raises(ValueError, match="Invalid init_info"):
        w.parse_init_info({k: v for k, v in INIT.items() if k != "world_size"})


def test_init_places_each_worker_at_its_rank() -> None:
    # worker w (vLLM's count: dp_index * TP*PP + rank) joins as rank_offset + w
    workers = [transfer_worker({}, i, 2) for i in range(2)]
    assert [w.worker_index for w in workers] == [0, 1]
    # a world that does not count the second worker
    small = workers[1].parse_init_info({**INIT, "world_size": 2})
    with pytest.raises(ValueError, match="rank 2, outside world_size 2"):
        workers[1].init_transfer_engine(small)
    with pytest.raises(ValueError, match="needs a CUDA worker"):
        workers[0].init_transfer_engine(workers[0].parse_init_info({**INIT, "backend": "nccl"}))


def test_update_info_parses_each_phase_and_names_what_is_wrong() -> None:
    w = transfer_worker({}, 0, 1)
    recv = w.parse_update_info({"phase": "recv", "round": 3, **META, "skip": ["b"]})
    assert (recv.phase, recv.round, recv.names, recv.skip) == ("recv", 3, ["a", "b"], ["b"])
    assert w.parse_update_info({"phase": "apply", "round": 3}).names == []
    assert w.parse_update_info({"phase": "discard", "round": 3}).phase == "discard"
    for info, match in [
        ({"phase": "swap", "round": 1}, "phase 'swap'"),
        ({"phase": "apply", "round": -1}, "must be >= 0"),
        ({"phase": "recv", "round": 1}, "at least one tensor"),
        ({"phase": "recv", "round": 1, **META, "dtypes": ["float32"]}, "equal lengths"),
        ({"phase": "recv", "round": 1, **META, "dtypes": ["float32", "f8"]}, r"unknown dtype"),
        ({"phase": "recv", "round": 1, **META, "shapes": [[2, -3], []]}, "non-negative"),
        ({"phase": "recv"}, "Invalid update_info"),
    ]:
        with pytest.raises(ValueError, match=match):
            w.parse_update_info(info)


def test_apply_without_a_received_round_refuses() -> None:
    w = transfer_worker({}, 0, 1)
    with pytest.raises(RuntimeError, match="no received round 4"):
        w.update_weights({"phase": "apply", "round": 4})
    with pytest.raises(RuntimeError, match="not in a weight group"):
        w.update_weights({"phase": "recv", "round": 4, **META})
    w.update_weights({"phase": "discard", "round": 4})  # nothing to drop: no error


# ---------------------------------------------------------------------------- end to end


def weights_of(model_dir: Path, scale: float, dtype: torch.dtype = torch.float32) -> dict:
    """The checkpoint's tensors times ``scale``, in ``dtype``."""
    return {
        k: (v * scale).to(dtype) for k, v in load_file(str(model_dir / "model.safetensors")).items()
    }


def served_by(engine: TensorEngine) -> list[dict[str, torch.Tensor]]:
    return [w.model.served for w in engine.workers]


def assert_serves(engine: TensorEngine, weights: dict[str, torch.Tensor]) -> None:
    for served in served_by(engine):
        for k, v in weights.items():
            torch.testing.assert_close(served[k], v.float(), rtol=0, atol=0)


def sender(*urls: str) -> CollectiveWeightSender:
    return CollectiveWeightSender(list(urls), "127.0.0.1", free_port(), timeout_s=30)


def test_rounds_land_in_every_worker_of_a_tensor_parallel_replica(tiny_model_dir: Path) -> None:
    engine = TensorEngine.of_model(tiny_model_dir, transfer_workers=2)
    with ServedApp(engine, tiny_model_dir) as rep:
        s = sender(rep.url)
        try:
            s.init()
            # GET /v1/weights/collective said 2 workers: ranks 1 and 2 after the learner's 0
            assert (s.workers, s.offsets, s.world_size) == ([2], [1], 3)
            assert [w.rank for w in engine.workers] == [1, 2]
            w1 = weights_of(tiny_model_dir, 2.0)
            assert s.send(w1, 1) == 1
            assert_serves(engine, w1)
            # bf16 on the wire, cast to the served float32 in each worker before the load
            w2 = weights_of(tiny_model_dir, 3.0, torch.bfloat16)
            assert s.send(w2, 2) == 2
            assert_serves(engine, w2)
            assert engine.updates == [1, 2]
            assert [w.model.loads for w in engine.workers] == [2, 2]

            # refusals change nothing, and the group survives them
            nan = dict(w1)
            nan["model.norm.weight"] = torch.full_like(nan["model.norm.weight"], float("nan"))
            partial = {"model.norm.weight": w1["model.norm.weight"]}
            for bad, ver, status, reason in [
                (nan, 3, 422, "non-finite"),  # seen by the workers after the broadcast
                (partial, 3, 422, "complete updates"),  # refused before it
                ({"model.nope": torch.zeros(3)}, 3, 422, "unknown parameter"),
                (w1, 2, 409, "conflict: version 2 <= 2"),
            ]:
                with pytest.raises(WeightSyncError, match=reason) as ei:
                    s.send(bad, ver)
                assert ei.value.status == status
                assert_serves(engine, w2)
            assert s.send(w1, 3) == 3
            assert_serves(engine, w1)
            assert engine.updates == [1, 2, 3]
        finally:
            s.close()


def test_a_refusing_replica_aborts_the_round_for_all(tiny_model_dir: Path) -> None:
    ahead = TensorEngine.of_model(tiny_model_dir)
    other = TensorEngine.of_model(tiny_model_dir)
    with ServedApp(ahead, tiny_model_dir) as a, ServedApp(other, tiny_model_dir) as b:
        s = sender(a.url, b.url)
        try:
            s.init()
            assert (s.offsets, s.world_size) == ([1, 2], 3)
            w1 = weights_of(tiny_model_dir, 2.0)
            assert s.send(w1, 5) == 5
            ahead.version = 9  # as if another learner had published v9 to it
            with pytest.raises(WeightSyncError, match="9") as ei:
                s.send(weights_of(tiny_model_dir, 4.0), 6)
            assert ei.value.status == 409
            # the other replica received nothing (go = abort) and still serves v5
            assert other.updates == [5] and ahead.updates == [5]
            assert_serves(other, w1)
            assert_serves(ahead, w1)
            assert all(w.round is None for w in other.workers + ahead.workers)
            ahead.version = 5
            w7 = weights_of(tiny_model_dir, 0.5)
            assert s.send(w7, 7) == 7
            assert_serves(other, w7)
            assert_serves(ahead, w7)
        finally:
            s.close()


def test_plane_routes_say_how_many_workers_and_refuse_a_world_too_small(
    tiny_model_dir: Path,
) -> None:
    import httpx

    engine = TensorEngine.of_model(tiny_model_dir, transfer_workers=2)
    with ServedApp(engine, tiny_model_dir) as rep:
        info = httpx.get(rep.url + "/v1/weights/collective").json()
        assert info == {"workers": 2, "backends": ["gloo"]}
        body: dict[str, Any] = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "world_size": 2,  # the learner and one worker: the second has no rank
            "rank": 1,
        }
        r = httpx.post(rep.url + "/v1/weights/collective/init", json=body)
        assert r.status_code == 400 and "2 vLLM worker(s)" in r.json()["detail"]
        r = httpx.post(rep.url + "/v1/weights/collective/init", json={**body, "backend": "nccl"})
        assert r.status_code == 400 and "nccl needs CUDA" in r.json()["detail"]


def test_the_shadow_forgets_what_a_collective_update_served(tiny_model_dir: Path) -> None:
    from services.inference.validation import ParamSpec
    from services.inference.worker import WeightShadow

    shadow = WeightShadow(ParamSpec.from_model_dir(tiny_model_dir))
    w1 = weights_of(tiny_model_dir, 2.0)
    shadow.update(w1)
    torch.testing.assert_close(
        shadow.get(["model.norm.weight"])["model.norm.weight"], w1["model.norm.weight"]
    )
    shadow.forget()  # a collective update: its tensors never passed through the API server
    assert shadow.stale
    with pytest.raises(RuntimeError, match="collective plane"):
        shadow.get(["model.norm.weight"])
    shadow.update({"model.norm.weight": w1["model.norm.weight"]})  # partial: still unknown
    assert shadow.stale
    w2 = weights_of(tiny_model_dir, 3.0)
    shadow.update(w2)  # a complete HTTP update: every served value known again
    assert not shadow.stale
    torch.testing.assert_close(
        shadow.get(["model.norm.weight"])["model.norm.weight"], w2["model.norm.weight"]
    )
