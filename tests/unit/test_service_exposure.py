"""What a service exposes and to whom: the /metrics and /health server binds the address its
settings name (every address by default: containers and pods are probed from outside;
loopback under ``ludic up``), and ``ludic up`` hands each service only the tokens it uses, in
files, never in its environment."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from libludic.secret_env import is_secret_name
from services.actor.settings import ActorSettings
from services.common.http import start_http
from services.common.redis_acl import ADMIN, RunUsers
from services.common.settings import load_settings
from services.launcher.settings import UpSettings
from services.launcher.stack import free_port
from services.launcher.supervisor import ServiceSpec
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
    # as sealed in-memory files (ServiceSpec.secrets), never values in an environment
    assert inf.secrets == {"LUDIC_API_KEY_FILE": r.api_key, "LUDIC_AUTH_TOKEN_FILE": r.token}
    assert not [k for k in inf.env if is_secret_name(k)]
    assert r.api_key != r.token and len(r.api_key) >= 32
    assert "127.0.0.1" in inf.argv


class RecordingSupervisor:
    def __init__(self) -> None:
        self.specs: dict[str, ServiceSpec] = {}

    def start(self, spec: ServiceSpec) -> None:
        self.specs[spec.name] = spec

    def wait_healthy(self, name: str, timeout_s: float) -> None:
        pass


@pytest.mark.parametrize("learner_nproc", [1, 2])
def test_ludic_up_hands_each_worker_its_secrets_as_files_and_nothing_else(
    tmp_path: Path, learner_nproc: int
) -> None:
    """Each worker gets its role's Redis URL and the tokens it uses, each in a file: a
    sealed memfd (``secrets``), or, for a torchrun learner whose agent passes its ranks no
    descriptor, a 0600 file of the run's private directory, removed when the run ends."""
    path = tmp_path / "run.yaml"
    up = {"name": "x", "runs_dir": str(tmp_path / "runs"), "actors": 1, "keep_env": "HF_TOKEN"}
    up["learner_nproc"] = learner_nproc
    path.write_text(yaml.safe_dump({"up": up}))
    r = Run(load_settings(UpSettings, ["--config", str(path)], service="up", environ={}))
    r.redis_users, r.redis_port = RunUsers(r.run_id), 6399
    r.redis_url = r.redis_users.url(ADMIN, "127.0.0.1", 6399)
    r.inference_url = "http://127.0.0.1:1"
    sup = RecordingSupervisor()
    r.sup = sup  # type: ignore[assignment]
    try:
        r.start_workers(tmp_path)
        specs = sup.specs
        assert sorted(specs) == ["actor-0", "credit", "feeder", "learner"]
        for name, spec in specs.items():
            assert not [k for k in spec.env if is_secret_name(k)], name
            assert "HF_TOKEN" in spec.keep_env, name  # up.keep_env: every service
        assert specs["actor-0"].secrets == {
            "LUDIC_REDIS_URL_FILE": r.redis_url_for("actor-0"),
            "LUDIC_API_KEY_FILE": r.api_key,
        }
        assert specs["feeder"].secrets == {"LUDIC_REDIS_URL_FILE": r.redis_url_for("feeder")}
        learner = specs["learner"]
        assert "WANDB_API_KEY" in learner.keep_env
        handed = {
            "LUDIC_REDIS_URL_FILE": r.redis_url_for("learner"),
            "LUDIC_AUTH_TOKEN_FILE": r.token,
        }
        if learner_nproc == 1:
            assert learner.secrets == handed
        else:
            assert learner.secrets == {} and r.secret_files is not None
            for var, value in handed.items():
                f = Path(learner.env[var])
                assert f.parent == Path(r.secret_files.dir) and f.read_text() == value
                assert stat.S_IMODE(f.stat().st_mode) == 0o600
    finally:
        if r.secret_files is not None:
            r.secret_files.close()
