"""One resolver for every ``kind`` a run config names: a short name or an import path.

A kind is either

* a short name registered under an entry-point group (Gymnasium's ``entry_point`` and
  pytest's plugins work the same way): an installed package declares, in its pyproject,
  ``[project.entry-points."ludic.envs"] guess = "my_pkg.envs:GuessEnv"``. libludic's own
  kinds (``arithmetic``, ``calculator``, ``xml``, ...) are registered this way too, in its
  own pyproject; or
* an import path ``package.module:Name`` (``Name`` may be dotted: ``mod:Class.factory``),
  which is imported as it is.

:data:`GROUPS` lists the groups (``envs`` -> ``ludic.envs`` ...). ``resolve(group, kind)``
returns the object (a class or a factory); ``check_kwargs`` compares keyword arguments with
its signature; ``build`` does both and calls it. Every error names the setting (``where``),
the value and the choices, with the nearest registered name when there is one.

This module imports nothing of libludic: every layer may resolve its kinds through it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any

#: group -> entry-point group name
GROUPS: dict[str, str] = {
    "envs": "ludic.envs",
    "protocols": "ludic.protocols",
    "agents": "ludic.agents",
    "tools": "ludic.tools",
    "parsers": "ludic.parsers",
    "contexts": "ludic.contexts",
    "rewards": "ludic.rewards",
    "credit": "ludic.credit",
    "losses": "ludic.losses",
}
#: what a kind of each group names (``ludic plugins`` and the errors say it)
CONTRACTS: dict[str, str] = {
    "envs": "a LudicEnv class or factory: kind(**kwargs) -> LudicEnv",
    "protocols": "a factory: kind(make_agent, **kwargs) -> InteractionProtocol",
    "agents": "an Agent class: kind(client, ctx, parser, sampling, return_spec, model, **kwargs)",
    "tools": "a plain function whose typed signature is the tool's JSON schema",
    "parsers": "a factory: kind(**kwargs) -> Parser (str -> ParseResult)",
    "contexts": "a ContextStrategy class: kind(**kwargs)",
    "rewards": "a reward function fn(sample, **kwargs) -> float (sync or async), or a class "
    "whose instances are one",
    "credit": "a CreditAssigner class: kind(**kwargs).compute(rollouts)",
    "losses": "a Loss class: kind(**kwargs).compute(logits, batch)",
}
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_SHORT_NAME = re.compile(r"[A-Za-z_][\w\-]*")


class PluginError(ValueError):
    """A kind that cannot be resolved or built; the message names the setting and the fix."""


class MissingDependency(PluginError):
    """The kind's module is there but a package it imports is not installed (an optional
    extra: ``pip install libludic[verifiers]``); ``module`` names the missing one."""

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


@dataclass(frozen=True)
class Plugin:
    """One registered kind: ``name`` in ``group`` is ``target`` (``module:attr``), declared
    by the installed distribution ``dist`` (``name==version``)."""

    group: str
    name: str
    target: str
    dist: str

    def load(self) -> Any:
        return import_target(self.target, f"{GROUPS[self.group]} entry point {self.name!r}")


def is_import_path(kind: str) -> bool:
    return bool(IMPORT_PATH.fullmatch(kind))


def _group(group: str) -> str:
    if group not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; groups: {sorted(GROUPS)}")
    return GROUPS[group]


@cache
def _entry_points(group: str) -> tuple[tuple[Plugin, ...], tuple[str, ...]]:
    """(the plugins of ``group``, names that two distributions register differently)."""
    found: dict[str, Plugin] = {}
    clashes: list[str] = []
    for ep in metadata.entry_points(group=_group(group)):
        dist = ep.dist
        origin = f"{dist.name}=={dist.version}" if dist is not None else "?"
        p = Plugin(group, ep.name, ep.value, origin)
        old = found.get(ep.name)
        if old is not None and old.target != p.target:  # the same one seen twice is fine
            clashes.append(f"{ep.name!r}: {old.target} ({old.dist}) and {p.target} ({p.dist})")
            continue
        found.setdefault(ep.name, p)
    return tuple(sorted(found.values(), key=lambda p: p.name)), tuple(clashes)


def registered(group: str) -> dict[str, Plugin]:
    """The short names of ``group`` (every installed distribution's entry points)."""
    return {p.name: p for p in _entry_points(group)[0]}


def clashes(group: str) -> list[str]:
    """Names of ``group`` that two installed distributions register with different targets."""
    return list(_entry_points(group)[1])


def refresh() -> None:
    """Forget the entry points read so far (a package installed since is seen next time)."""
    _entry_points.cache_clear()


def import_target(target: str, where: str) -> Any:
    """The object ``module:attr`` names (``attr`` may be dotted)."""
    if not is_import_path(target):
        raise PluginError(f"{where}: {target!r} is not an import path like 'package.module:Name'")
    module_name, attr = target.split(":", 1)
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ImportError:  # a parent package is missing
        found = False
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None) or module_name
        if found and missing != module_name:
            raise MissingDependency(
                f"{where}: {module_name!r} needs {missing!r}, which is not installed: {e}",
                missing,
            ) from e
        raise PluginError(
            f"{where}: cannot import {module_name!r} ({type(e).__name__}: {e}); install the "
            f"package that provides {missing!r} where every service runs (pip install ...; "
            "in an image: a Dockerfile FROM the project's image, see the README)"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(
                f"{where}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def _choices(names: Iterable[str]) -> str:
    names = sorted(names)
    return "[" + ", ".join(names) + "]" if names else "[] (none registered)"


def resolve(group: str, kind: Any, *, where: str | None = None) -> Any:
    """The class or factory ``kind`` names in ``group``: a registered short name or an
    import path. ``where`` names the setting in errors (default ``<group> kind``)."""
    where = where or f"{group[:-1] if group.endswith('s') else group} kind"
    plugins, clashes = _entry_points(group)
    if not isinstance(kind, str) or not kind:
        raise PluginError(
            f"{where}={kind!r}: give a registered name {_choices(p.name for p in plugins)} or "
            "an import path 'package.module:Name'"
        )
    if is_import_path(kind):
        return import_target(kind, f"{where}={kind!r}")
    for c in clashes:
        if c.startswith(repr(kind) + ":"):
            raise PluginError(
                f"{where}={kind!r} is registered by two installed packages: {c}; name the one "
                "you mean by its import path"
            )
    by_name = {p.name: p for p in plugins}
    if kind in by_name:
        return by_name[kind].load()
    near = difflib.get_close_matches(kind, list(by_name), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    if not by_name:
        hint += (
            f" (no package registers entry points in {GROUPS[group]}: is libludic installed "
            "with pip, e.g. pip install -e .?)"
        )
    kind_shape = "" if _SHORT_NAME.fullmatch(kind) else " (an import path is 'package.module:Name')"
    raise PluginError(
        f"{where}={kind!r} is unknown{kind_shape}; registered: "
        f"{_choices(by_name)}{hint}; or give an import path 'package.module:Name'"
    )


def parameters(target: Any, injected: Iterable[str] = ()) -> tuple[list[str], bool]:
    """(keyword parameters ``target`` takes besides ``injected``, whether it takes
    ``**kwargs`` as well)."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: accept anything
        return [], True
    skip = set(injected) | {"self"}
    names, extra = [], False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            extra = True
        elif p.kind is not inspect.Parameter.VAR_POSITIONAL and p.name not in skip:
            names.append(p.name)
    return names, extra


def check_kwargs(
    target: Any,
    kwargs: Mapping[str, Any],
    *,
    where: str,
    injected: Iterable[str] = (),
    require: bool = True,
) -> None:
    """PluginError when ``kwargs`` holds a keyword ``target`` does not take (the message
    lists the ones it does) or (``require``) misses one it requires. ``injected``: arguments
    the caller supplies itself (``client``, ``make_agent``), never a config's."""
    injected = tuple(injected)
    names, extra = parameters(target, injected)
    unknown = sorted(set(kwargs) - set(names))
    if unknown and not extra:
        near = [m for u in unknown for m in difflib.get_close_matches(u, names, n=1)]
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise PluginError(f"{where}: unknown keyword(s) {unknown}; known: {names or 'none'}{hint}")
    if not require:
        return
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    required = [
        p.name
        for p in sig.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and p.name not in injected
        and p.name != "self"
        and p.name not in kwargs
    ]
    if required:
        raise PluginError(f"{where}: missing required keyword(s) {required}; known: {names}")


def build(
    group: str,
    kind: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    where: str | None = None,
    **injected: Any,
) -> Any:
    """``resolve(group, kind)(**injected, **kwargs)`` after ``check_kwargs``; a TypeError
    or ValueError the constructor raises comes back as a PluginError naming ``where``."""
    where = where or f"{group} kind {kind!r}"
    target = resolve(group, kind, where=where)
    kwargs = dict(kwargs or {})
    check_kwargs(target, kwargs, where=f"{where} ({kind})", injected=injected)
    return call(target, f"{where} ({kind})", **injected, **kwargs)


def call(target: Callable[..., Any], where: str, **kwargs: Any) -> Any:
    """``target(**kwargs)``, its TypeError or ValueError raised as a PluginError naming
    ``where``."""
    try:
        return target(**kwargs)
    except PluginError:
        raise
    except (TypeError, ValueError) as e:
        raise PluginError(f"{where}: {e}") from e


def origin_of(group: str, kind: str) -> str:
    """Where ``kind`` comes from: its distribution for a short name, else its import path."""
    p = registered(group).get(kind)
    return p.dist if p is not None else kind
