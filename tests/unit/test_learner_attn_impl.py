"""``learner.attn_impl`` (AReaL's ``attn_impl``): the trained model's attention
implementation, read from the run config and checked."""

from __future__ import annotations

import pytest
import yaml

from services.common.settings import load_settings
from services.learner.settings import LearnerSettings
from services.learner.worker import load_policy


def settings(tmp_path, model_dir, **learner) -> LearnerSettings:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"learner": {"model_dir": str(model_dir), **learner}}))
    return load_settings(LearnerSettings, ["--config", str(path)], service="learner", environ={})


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_policy_is_loaded_with_the_attention_implementation(tmp_path, tiny_model_dir, impl):
    for weights in (True, False):
        model = load_policy(settings(tmp_path, tiny_model_dir, attn_impl=impl), weights=weights)
        assert model.config._attn_implementation == impl


def test_unknown_attention_implementations_are_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        settings(tmp_path, tiny_model_dir, attn_impl="flash")
