"""libludic/plugins.py: a kind is a registered short name or an import path; its keywords
are checked against its signature; every error names the setting, the value and the
choices."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

from libludic import plugins
from libludic.envs.arithmetic import ArithmeticEnv
from libludic.plugins import PluginError


def test_builtin_kinds_are_registered_through_entry_points_like_a_users():
    # libludic's own pyproject declares them; nothing else lists them
    envs = plugins.registered("envs")
    assert {"arithmetic", "tic_tac_toe", "tic_tac_toe_2p", "code_exec", "dataset_qa"} <= set(envs)
    assert envs["arithmetic"].target == "libludic.envs.arithmetic:ArithmeticEnv"
    assert envs["arithmetic"].dist.startswith("libludic==")
    absent = []
    for group in plugins.GROUPS:
        for p in plugins.registered(group).values():
            try:
                assert p.load() is not None, p  # every registered target imports
            except plugins.MissingDependency as e:  # an optional extra, its own venv
                absent.append((p.name, e.module))
    # verifiers pins mcp and openai below what vLLM holds: it lives in a venv of its own
    # (scripts/adapter-venvs.sh); every other kind imports in the project's venv
    assert absent in ([], [("verifiers", "verifiers")]), absent


def test_a_short_name_and_an_import_path_resolve_to_the_same_object():
    assert plugins.resolve("envs", "arithmetic") is ArithmeticEnv
    assert plugins.resolve("envs", "libludic.envs.arithmetic:ArithmeticEnv") is ArithmeticEnv
    # a dotted attribute after the colon
    assert plugins.resolve("envs", "libludic.envs.arithmetic:ArithmeticEnv.env_reset") is (
        ArithmeticEnv.env_reset
    )


@pytest.mark.parametrize(
    "kind, match",
    [
        ("arithmetik", r"env.kind='arithmetik' is unknown; registered: \[arithmetic, .*\]; did "
         r"you mean 'arithmetic'\?; or give an import path 'package.module:Name'"),
        ("no_such_pkg.envs:Env", r"cannot import 'no_such_pkg.envs' \(ModuleNotFoundError.*install "
         r"the package that provides 'no_such_pkg'"),
        ("libludic.envs.arithmetic:Nope", r"module 'libludic.envs.arithmetic' has no attribute 'Nope'"),
        ("my/env.py", r"is unknown \(an import path is 'package.module:Name'\)"),
        ("", r"give a registered name \[arithmetic"),
        (3, r"env.kind=3: give a registered name"),
    ],
)  # fmt: skip
def test_a_kind_that_does_not_resolve_names_the_setting_and_the_choices(kind: Any, match: str):
    with pytest.raises(PluginError, match=match):
        plugins.resolve("envs", kind, where="env.kind")


def test_keywords_are_checked_against_the_signature():
    plugins.check_kwargs(ArithmeticEnv, {"digits": 3}, where="env")
    with pytest.raises(
        PluginError,
        match=r"env: unknown keyword\(s\) \['digit'\]; known: \['digits', .*did you mean 'digits'",
    ):
        plugins.check_kwargs(ArithmeticEnv, {"digit": 3}, where="env")

    def needs(a: int, *, b: int = 1) -> int:
        return a + b

    with pytest.raises(PluginError, match=r"missing required keyword\(s\) \['a'\]"):
        plugins.check_kwargs(needs, {}, where="f")
    plugins.check_kwargs(needs, {}, where="f", require=False)
    # injected arguments are the caller's, never a config's
    with pytest.raises(PluginError, match=r"unknown keyword\(s\) \['a'\]; known: \['b'\]"):
        plugins.check_kwargs(needs, {"a": 1}, where="f", injected=("a",))

    def anything(**kw: Any) -> None: ...

    plugins.check_kwargs(anything, {"whatever": 1}, where="f")


def test_build_calls_with_injected_arguments_and_names_a_constructor_error():
    env = plugins.build("envs", "arithmetic", {"digits": 1}, where="feeder.tasks[0].env")
    assert isinstance(env, ArithmeticEnv)
    with pytest.raises(PluginError, match=r"feeder.tasks\[0\].env \(arithmetic\): .*split"):
        plugins.build("envs", "arithmetic", {"split": "test"}, where="feeder.tasks[0].env")


class _Dist:
    def __init__(self, name: str) -> None:
        self.name, self.version = name, "1.0"


def _ep(name: str, value: str, dist: str) -> metadata.EntryPoint:
    ep = metadata.EntryPoint(name, value, "ludic.envs")
    return ep._for(_Dist(dist))  # type: ignore[attr-defined]


def test_two_packages_registering_one_name_differently_is_an_error_naming_both(monkeypatch):
    eps = [
        _ep("guess", "pkg_a.envs:Guess", "pkg-a"),
        _ep("guess", "pkg_b.envs:Guess", "pkg-b"),
        _ep("same", "pkg_a.envs:Same", "pkg-a"),
        _ep("same", "pkg_a.envs:Same", "pkg-a"),  # one distribution seen twice on sys.path
    ]
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda group: eps)
    plugins.refresh()
    try:
        assert set(plugins.registered("envs")) == {"guess", "same"}
        assert plugins.clashes("envs") == [
            "'guess': pkg_a.envs:Guess (pkg-a==1.0) and pkg_b.envs:Guess (pkg-b==1.0)"
        ]
        with pytest.raises(PluginError, match=r"registered by two installed packages.*pkg-b"):
            plugins.resolve("envs", "guess")
    finally:
        monkeypatch.undo()
        plugins.refresh()


def test_ludic_plugins_lists_and_loads_every_kind(capsys):
    from services.plugins import main

    assert main(["--load"]) == 0
    out = capsys.readouterr().out
    assert (
        "ludic.envs" in out
        and "arithmetic" in out
        and "libludic.envs.arithmetic:ArithmeticEnv" in out
    )
    assert "ludic.rewards" in out and "llm_judge" in out and "FAILED" not in out
    assert main(["--group", "tools", "--json"]) == 0
    listed = capsys.readouterr().out
    assert '"name": "calculator"' in listed and '"group": "envs"' not in listed
