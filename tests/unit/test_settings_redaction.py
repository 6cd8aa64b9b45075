"""Settings as users see them: no secret reaches a start-up log line or the learner's
wandb/TensorBoard config (fields named like a secret are masked, and so is the password
inside every URL). (``--help``: tests/unit/test_settings_precedence.py.)"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from services.actor.settings import ActorSettings
from services.common.settings import log_settings, redact_url, redacted
from services.credit.settings import CreditSettings
from services.eval.settings import EvalSettings
from services.feeder.settings import FeederSettings
from services.learner.settings import LearnerSettings

PASSWORD = "pw-5f3c9e"
TOKEN = "tok-81ad20"


@pytest.mark.parametrize(
    "cls", [ActorSettings, CreditSettings, EvalSettings, FeederSettings, LearnerSettings]
)
def test_start_up_config_line_masks_the_redis_password_and_tokens(cls, caplog) -> None:
    s = cls()
    changes = {"redis_url": f"redis://:{PASSWORD}@redis:6379/0"}
    for name in ("auth_token", "api_key"):
        if name in {f.name for f in dataclasses.fields(s)}:
            changes[name] = TOKEN
    s = dataclasses.replace(s, **changes)
    with caplog.at_level(logging.INFO):
        log_settings(logging.getLogger("t"), "svc", s)
    text = caplog.text
    assert "redis://:***@redis:6379/0" in text  # the URL stays readable
    assert PASSWORD not in text and TOKEN not in text
    assert PASSWORD not in str(redacted(s)) and TOKEN not in str(redacted(s))


def test_redact_url_masks_only_the_password() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://user:pw@h/0 and https://a:b@x.io/p") == (
        "redis://user:***@h/0 and https://a:***@x.io/p"
    )
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"  # nothing to hide
    assert redact_url("http://10.0.0.1:8000,http://10.0.0.2:8000") == (
        "http://10.0.0.1:8000,http://10.0.0.2:8000"
    )
