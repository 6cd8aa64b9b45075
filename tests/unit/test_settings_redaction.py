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


@pytest.mark.parametrize(
    "cls", [ActorSettings, CreditSettings, EvalSettings, FeederSettings, LearnerSettings]
)
def test_the_redis_url_comes_from_a_file(cls, tmp_path) -> None:
    """redis_url_file (a mounted Secret): the password stays out of the environment and argv;
    the file's URL is used, an unreadable or empty file is an error naming it, and a
    LUDIC_REDIS_URL that disagrees with it is refused rather than one silently winning."""
    from services.common.settings import load_settings

    url = f"redis://:{PASSWORD}@redis:6379/3"
    f = tmp_path / "redis-url"
    f.write_text(url + "\n")
    env = {"LUDIC_REDIS_URL_FILE": str(f)}
    assert load_settings(cls, [], service="svc", environ=env).redis_url == url
    same = {**env, "LUDIC_REDIS_URL": url}
    assert load_settings(cls, [], service="svc", environ=same).redis_url == url
    with pytest.raises(ValueError, match="both give a value, and they differ"):
        load_settings(
            cls, [], service="svc", environ={**env, "LUDIC_REDIS_URL": "redis://other:6379/0"}
        )
    with pytest.raises(ValueError, match="cannot read redis_url file"):
        load_settings(cls, [], service="svc", environ={"LUDIC_REDIS_URL_FILE": str(f) + ".x"})
    f.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_settings(cls, [], service="svc", environ=env)
