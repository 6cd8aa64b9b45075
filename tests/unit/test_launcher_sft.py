"""`ludic up`: the SFT warm-start settings reach `run_sft`; inference gets its config section."""

from __future__ import annotations

import json
import os

import torch
import yaml
from safetensors.torch import load_file

from services.common.secrets import FD_PATH, secret_fd
from services.common.settings import load_settings
from services.inference.settings import InferenceSettings
from services.launcher.main import Run, prepare_model
from services.launcher.settings import UpSettings


def test_sft_seed_and_schedule_reach_the_warm_start(tiny_model_dir, tmp_path) -> None:
    def warm(run: str, **kw: object) -> dict:
        s = UpSettings(model=str(tiny_model_dir), sft_steps=3, sft_batch_size=8, sft_lr=1e-2, **kw)  # type: ignore[arg-type]
        out = prepare_model(s, tmp_path / run)
        return load_file(str(out / "model.safetensors"))

    a, b = warm("a", sft_seed=0), warm("b", sft_seed=0)
    c = warm("c", sft_seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # another data order
    d = warm("d", sft_seed=0, sft_lr_schedule="linear")  # decayed lr: other weights
    assert any(not torch.equal(a[k], d[k]) for k in a)
    args = json.loads((tmp_path / "d" / "sft" / "sft_done.json").read_text())["args"]
    assert args["seed"] == 0 and args["lr_schedule"] == "linear"


def test_inference_gets_the_inference_section_of_the_run_config(tiny_model_dir, tmp_path) -> None:
    """The launcher starts `ludic inference` with LUDIC_CONFIG, as every service: its
    ``inference:`` section applies, the other sections do not."""
    cfg = {"run_id": "r", "inference": {"max_model_len": 96}, "learner": {"batch_size": 8}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    s = UpSettings(runs_dir=str(tmp_path), config_path=str(tmp_path / "run.yaml"))
    run = Run(s)
    run.redis_url = "redis://127.0.0.1:1/0"
    spec = run.inference_spec(tiny_model_dir, 8123)
    assert "LUDIC_INFERENCE_CONFIG" not in spec.env
    argv = spec.argv[spec.argv.index("inference") + 1 :]
    # its tokens as the supervisor hands them over: sealed memfds at /dev/fd/<n>
    fds = {var: secret_fd(var.lower(), value) for var, value in spec.secrets.items()}
    try:
        environ = {**spec.env, **{var: f"{FD_PATH}{fd}" for var, fd in fds.items()}}
        got = load_settings(InferenceSettings, argv, service="inference", environ=environ)
    finally:
        for fd in fds.values():
            os.close(fd)
    assert (got.model_dir, got.port, got.max_model_len) == (str(tiny_model_dir), 8123, 96)
    assert got.auth_token == run.token and got.api_key == run.api_key
