"""One settings loader for every service, one precedence.

Each ``ludic <service>`` implemented in ``services/`` (the subcommands of services/cli.py)
loads its settings through ``services.common.settings.load_settings``: defaults < the run
config's ``<service>:`` section (``--config`` / ``LUDIC_CONFIG``) < ``LUDIC_<FIELD>`` <
``--field-name``, and its ``--help`` shows every key's default and environment variable. The
commands run for real up to the loader, which is spied on: it loads, then stops the command
before anything starts. A new service command that loads its settings another way fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from services import cli
from services.common import secrets
from services.common import settings as common

# services/ commands that are tools, not services: why each has no settings object
NOT_SERVICES = {
    "status": "a one-shot look at Redis (--redis-url, --run-id, --json)",
    "demo": "a one-process script of the library (--run-dir, --size, --groups, --group-size)",
    "plugins": "a listing of the installed entry points (--group, --load, --json)",
    "check": "a one-shot build of a run config's every setting, each through its own loader",
}
SERVICES = sorted(
    name
    for name, (target, _) in cli.COMMANDS.items()
    if target.startswith("services.") and name not in NOT_SERVICES
)
# what a service cannot start without, given on every call (never the field under test)
NEEDS: dict[str, Callable[[Path], list[str]]] = {
    "inference": lambda model: ["--model-dir", str(model)],
}


LOAD, KEEP_SECRETS = common.load_settings, secrets.keep_secrets_in  # before any spy


class Loaded(Exception):
    """Raised by the spy once the settings are loaded: the command goes no further."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings


def run_command(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``ludic <name> argv`` up to its settings: every reference a ``services`` module holds to
    the shared loader is replaced by a spy (and ``keep_secrets_in``, which would make the test
    process non-dumpable, by a no-op). Returns the spy's calls ``(cls, service, result)``."""
    module, fn = cli.COMMANDS[name][0].split(":")
    main = getattr(importlib.import_module(module), fn)
    calls = []

    def spy(cls: type, argv: Any, *, service: str, **kw: Any) -> Any:
        calls.append((cls, service))
        raise Loaded(LOAD(cls, argv, service=service, **kw))

    spy.__wrapped__ = LOAD  # type: ignore[attr-defined]
    for mod in [m for n, m in sys.modules.items() if n.startswith("services.")]:
        for attr, value in list(vars(mod).items()):
            if getattr(value, "__wrapped__", value) is LOAD:  # the loader or an earlier spy
                monkeypatch.setattr(mod, attr, spy)
            elif value is KEEP_SECRETS:
                monkeypatch.setattr(mod, attr, lambda: False)
    loaded = None
    try:
        main(argv)
    except Loaded as e:
        loaded = e.settings
    except SystemExit:  # --help
        pass
    if not calls:
        pytest.fail(f"`ludic {name}` does not load its settings with {common.__name__}")
    return [(*c, loaded) for c in calls]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith(common.ENV_PREFIX):
            monkeypatch.delenv(k)
    monkeypatch.setenv("COLUMNS", "1000")  # argparse: one line per option


def precedence_field(cls: type) -> dataclasses.Field[Any]:
    """The service's first plain ``int`` setting (default d: YAML d+1, env d+2, flag d+3)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and hints[f.name] is int and type(f.default) is int:
            return f
    raise AssertionError(f"{cls.__name__} has no int setting to check the precedence with")


def test_the_services_are_found() -> None:
    assert {"inference", "actor", "credit", "learner", "feeder", "eval", "up"} <= set(SERVICES)


@pytest.mark.parametrize("service", SERVICES)
def test_yaml_then_environment_then_flags(
    service: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs = NEEDS.get(service, lambda _: [])(tiny_model_dir)
    ((cls, called, defaults),) = run_command(service, needs, monkeypatch)
    assert called == service  # its YAML section is `<service>:`
    f = precedence_field(cls)
    d = getattr(defaults, f.name)
    assert d == f.default

    def value(*argv: str) -> int:
        ((_, _, s),) = run_command(service, [*needs, *argv], monkeypatch)
        return int(getattr(s, f.name))

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"run_id": "r", service: {f.name: d + 1}}))
    monkeypatch.setenv("LUDIC_CONFIG", str(cfg))
    assert value() == d + 1  # YAML over the default
    monkeypatch.setenv(f"LUDIC_{f.name.upper()}", str(d + 2))
    assert value() == d + 2  # environment over YAML
    assert value(f"--{f.name.replace('_', '-')}", str(d + 3)) == d + 3  # flag over both


@pytest.mark.parametrize("service", SERVICES)
def test_help_shows_every_keys_default_and_environment_variable(
    service: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ((cls, called, _),) = run_command(service, ["--help"], monkeypatch)
    assert called == service
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = common._default_text(f).replace("%%", "%")
        env = f"LUDIC_{f.name.upper()}"
        if "env_only" in f.metadata:  # listed after the flags: no flag, no YAML key
            assert f"{env}: {f.metadata.get('help', '')} [default {default}]" in text, f.name
        else:
            assert f"--{f.name.replace('_', '-')} " in text, f.name
            assert f"[default {default}; env {env}]" in text, f.name


@pytest.mark.parametrize("service", SERVICES)
def test_a_secret_is_read_from_the_environment_only(
    service: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command line is visible to every user of the machine and a run config is committed:
    a setting holding a secret (a token, a password) has no flag and no YAML key. Its file
    (``*_file``, a path) may come from anywhere."""
    needs = NEEDS.get(service, lambda _: [])(tiny_model_dir)
    ((cls, _, _),) = run_command(service, needs, monkeypatch)
    for f in dataclasses.fields(cls):
        if f.init and common._is_secret(f.name) and not f.name.endswith("_file"):
            assert "env_only" in f.metadata, f"{service}: {f.name} can be set by a flag or YAML"
            flag = f"--{f.name.replace('_', '-')}"
            ((_, _, loaded),) = run_command(service, [*needs, flag, "s3cret"], monkeypatch)
            assert loaded is None, f"{service}: {flag} was accepted"  # argparse exited 2
