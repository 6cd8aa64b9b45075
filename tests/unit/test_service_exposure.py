"""What a service exposes and to whom: the /metrics and /health server binds the address its
settings name (every address by default: containers and pods are probed from outside;
loopback under ``ludic up``), and ``ludic up`` hands each service only the tokens it uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.actor.settings import ActorSettings
from services.common.http import start_http
from services.common.redis_acl import ADMIN, RunUsers
from services.common.settings import load_settings
from services.launcher.settings import UpSettings
from services.launcher.stack import free_port
from services.launcher.worker import Run


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_the_metrics_server_binds_the_address_it_is_given(host: str) -> None:
    server = await start_http(free_port(), host=host)
    assert server is not None
    try:
        assert {s.getsockname()[0] for s in server.sockets} == {host}
    finally:
        server.close()


def test_metrics_host_is_every_address_by_default_and_read_from_the_environment() -> None:
    assert load_settings(ActorSettings, [], service="actor", environ={}).metrics_host == "0.0.0.0"
    s = load_settings(
        ActorSettings, [], service="actor", environ={"LUDIC_METRICS_HOST": "127.0.0.1"}
    )
    assert s.metrics_host == "127.0.0.1"


def test_ludic_up_binds_every_service_to_loopback_and_gives_tokens_by_need(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"up": {"name": "x", "runs_dir": str(tmp_path / "runs")}}))
    r = Run(load_settings(UpSettings, ["--config", str(path)], service="up", environ={}))
    r.redis_users, r.redis_port = RunUsers(r.run_id), 6399
    r.redis_url = r.redis_users.url(ADMIN, "127.0.0.1", 6399)
    base = r.env()
    assert base["LUDIC_METRICS_HOST"] == "127.0.0.1"
    for secret in ("LUDIC_API_KEY", "LUDIC_AUTH_TOKEN", "LUDIC_REDIS_URL"):
        assert secret not in base  # not for every one: inference gets no Redis URL
    # each service its role's Redis user, never the admin's (this process keeps that one)
    for service, user in [("actor-3", "ludic-actor"), ("learner", "ludic-learner")]:
        url = r.redis_url_for(service)
        assert url.startswith(f"redis://{user}:") and r.redis_users.passwords[ADMIN] not in url
    inf = r.inference_spec(tmp_path, free_port())
    assert inf.env["LUDIC_API_KEY"] == r.api_key and inf.env["LUDIC_AUTH_TOKEN"] == r.token
    assert r.api_key != r.token and len(r.api_key) >= 32
    assert "127.0.0.1" in inf.argv
