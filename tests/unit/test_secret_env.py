"""Which environment variables carry a secret (libludic/secret_env.py), the environment a
child gets without them, and a service dropping them from its own (services/common/secrets.py).
How `ludic up` hands a service the secrets it does need: tests/unit/test_secret_handover.py."""

from __future__ import annotations

import pytest

from libludic.secret_env import SECRET_ENV, child_env, is_secret_name, secret_names
from services.common.secrets import drop_secret_env

SECRET = "s3cret-5d2e91"


@pytest.mark.parametrize(
    "name",
    [
        *SECRET_ENV,  # ludic's own, named
        "HF_TOKEN",
        "GITHUB_TOKEN",
        "WANDB_API_KEY",
        "OPENAI_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY",
        "DB_PASSWORD",
        "SMTP_PASSWD",
        "CLIENT_SECRET",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "TOKEN",
        "password",  # any case
    ],
)
def test_a_secret_bearing_name_is_one(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "PATH",
        "HOME",
        "LUDIC_REDIS_URL_FILE",  # a path: how a child that needs the secret gets it
        "LUDIC_AUTH_TOKEN_FILE",
        "LUDIC_RUN_ID",
        "LUDIC_CONFIG",
        "TOKENIZERS_PARALLELISM",
        "LUDIC_MAX_NEW_TOKENS",
        "WANDB_PROJECT",
        "SSH_AUTH_SOCK",
        "LUDIC_SANDBOX_ALLOW",
        "VLLM_CPU_KVCACHE_SPACE",
    ],
)
def test_an_ordinary_name_is_not(name: str) -> None:
    assert not is_secret_name(name)


def test_child_env_drops_every_secret_and_keeps_the_rest_and_what_keep_names() -> None:
    parent = {
        "PATH": "/usr/bin",
        "LUDIC_RUN_ID": "r1",
        "LUDIC_REDIS_URL": f"redis://u:{SECRET}@h:6379/0",
        "LUDIC_REDIS_URL_FILE": "/run/secrets/ludic/redis-url",
        "LUDIC_AUTH_TOKEN": SECRET,
        "HF_TOKEN": SECRET,
        "WANDB_API_KEY": SECRET,
    }
    assert child_env(parent) == {
        "PATH": "/usr/bin",
        "LUDIC_RUN_ID": "r1",
        "LUDIC_REDIS_URL_FILE": "/run/secrets/ludic/redis-url",
    }
    kept = child_env(parent, keep=("WANDB_API_KEY",))
    assert kept["WANDB_API_KEY"] == SECRET and "HF_TOKEN" not in kept
    assert secret_names(parent) == [
        "HF_TOKEN",
        "LUDIC_AUTH_TOKEN",
        "LUDIC_REDIS_URL",
        "WANDB_API_KEY",
    ]
    assert parent["HF_TOKEN"] == SECRET  # a copy: the parent's mapping is untouched


def test_child_env_reads_this_process_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("LUDIC_TEST_PLAIN", "x")
    env = child_env()
    assert "HF_TOKEN" not in env and env["LUDIC_TEST_PLAIN"] == "x"


def test_drop_secret_env_drops_ludics_own_or_every_secret() -> None:
    env = {"LUDIC_API_KEY": SECRET, "REDISCLI_AUTH": SECRET, "HF_TOKEN": SECRET, "PATH": "/b"}
    assert drop_secret_env(env) == ["LUDIC_API_KEY", "REDISCLI_AUTH"]
    assert env == {"HF_TOKEN": SECRET, "PATH": "/b"}  # a service's own tools may need it
    assert drop_secret_env(env, every=True) == ["HF_TOKEN"]  # inference: vLLM's engine
    assert env == {"PATH": "/b"}
