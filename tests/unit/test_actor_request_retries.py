"""``actor.request_retries`` (AReaL's ``request_retries``): read from the run config, checked,
and handed to the inference pool the actor builds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from services.actor import main as actor_main
from services.actor.settings import ActorSettings
from services.common.settings import load_settings


def settings(tmp_path, **actor: Any) -> ActorSettings:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"actor": {"inference_urls": ["http://x:1"], **actor}}))
    return load_settings(ActorSettings, ["--config", str(path)], service="actor", environ={})


def test_request_retries_reach_the_pool(tmp_path, monkeypatch) -> None:
    seen: dict[str, Any] = {}

    class Built(Exception):
        pass

    def pool(urls: list[str], **kw: Any) -> Any:
        seen.update(kw)
        raise Built

    monkeypatch.setattr(actor_main, "InferencePool", pool)
    for retries in (0, 4):
        with pytest.raises(Built):
            asyncio.run(actor_main.run(settings(tmp_path, request_retries=retries)))
        assert seen["max_retries"] == retries
    assert settings(tmp_path).request_retries == 1  # default: then the next replica


@pytest.mark.parametrize("bad", [-1, True])
def test_request_retries_must_be_a_count(tmp_path, bad) -> None:
    with pytest.raises(ValueError, match="request_retries"):
        settings(tmp_path, request_retries=bad)
