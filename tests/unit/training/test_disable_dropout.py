"""``TrainerConfig.disable_dropout`` (AReaL's name): every dropout of the policy off while it
trains, the layers' and transformers' attention dropout alike, LoRA's included."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from libludic.models.tiny import PAD_ID
from libludic.training.config import TrainerConfig
from libludic.training.policies import disable_dropout
from libludic.training.presets import make_sft
from libludic.training.trainer import Trainer
from tests.fakes import ListBatchSource


def dropout_model(tiny_model_dir) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.attention_dropout = 0.5  # Qwen2: functional dropout on the attention weights
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def two_forwards(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    ids = torch.tensor([[5, 9, 13, 7, 21, 4]])
    return model(input_ids=ids).logits, model(input_ids=ids).logits


def test_disable_dropout_makes_training_forwards_deterministic(tiny_model_dir) -> None:
    model = dropout_model(tiny_model_dir)
    a, b = two_forwards(model)
    assert not torch.allclose(a, b)  # dropout is on in train mode
    assert disable_dropout(model) > 0
    a, b = two_forwards(model)
    assert torch.equal(a, b)
    assert disable_dropout(model) == 0  # nothing left on


def test_trainer_config_disable_dropout_reaches_the_policy(tiny_model_dir) -> None:
    for off, lora in ((True, None), (True, 4), (False, None)):
        cfg = TrainerConfig(
            model_device="cpu",
            mixed_precision_dtype=None,
            pad_token_id=PAD_ID,
            disable_dropout=off,
            lora_rank=lora,
            lora_dropout=0.3 if lora else 0.0,
        )
        tr = Trainer(
            model=dropout_model(tiny_model_dir),
            algo=make_sft(),
            batch_source=ListBatchSource([]),
            cfg=cfg,
        )
        a, b = two_forwards(tr.model)
        assert torch.equal(a, b) is off, (off, lora)


def test_the_run_config_sets_it_under_learner_trainer(tmp_path) -> None:
    from services.common.settings import load_settings
    from services.learner.settings import LearnerSettings

    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  model_dir: /x\n  trainer: {disable_dropout: true}\n")
    s = load_settings(LearnerSettings, ["--config", str(path)], service="learner", environ={})
    assert s.trainer_config().disable_dropout is True
