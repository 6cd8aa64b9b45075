"""Parsers turn raw model text into an action plus a format reward.

``Parser = Callable[[str], ParseResult]``. On success ``action`` is the extracted action
and ``reward`` the format bonus (``success_reward``); on failure ``action`` is None,
``reward`` the penalty (``error_reward``) and ``obs`` a feedback message the protocol
shows the agent instead of stepping the environment.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from libludic import plugins
from libludic.plugins import PluginError


@dataclass(frozen=True)
class ParseResult:
    action: str | None
    reward: float
    obs: str | None

    @property
    def ok(self) -> bool:
        return self.action is not None


Parser = Callable[[str], ParseResult]


def identity_parser(text: str) -> ParseResult:
    """Accept the text as the action (stripped), no format reward."""
    return ParseResult(action=text.strip(), reward=0.0, obs=None)


def xml_parser(
    tag: str,
    exact: bool = False,
    success_reward: float = 0.0,
    error_reward: float = -1.0,
) -> Parser:
    """Extract the content of ``<tag>...</tag>``.

    exact=True: the whole (stripped) output must be a single ``<tag>...</tag>`` element.
    exact=False: the last such element anywhere in the output is taken.
    """
    if not re.fullmatch(r"[A-Za-z_][\w\-]*", tag):
        raise ValueError(f"xml_parser tag {tag!r} is not a valid XML tag name")
    elem = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)
    whole = re.compile(rf"\s*<{tag}>(.*?)</{tag}>\s*", re.DOTALL)

    def parse(text: str) -> ParseResult:
        if exact:
            m = whole.fullmatch(text)
            if m is None or f"<{tag}>" in m.group(1):
                return ParseResult(
                    None,
                    error_reward,
                    f"Invalid format: reply with exactly <{tag}>...</{tag}> and nothing else.",
                )
            return ParseResult(m.group(1).strip(), success_reward, None)
        found = elem.findall(text)
        if not found:
            return ParseResult(
                None, error_reward, f"Invalid format: put your answer inside <{tag}>...</{tag}>."
            )
        return ParseResult(found[-1].strip(), success_reward, None)

    return parse


def think_prefix_parser(success_reward: float = 0.0, error_reward: float = -1.0) -> Parser:
    """Require the output to open with a ``<think>...</think>`` block; the action is the rest."""
    pat = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)

    def parse(text: str) -> ParseResult:
        m = pat.fullmatch(text)
        if m is None:
            return ParseResult(
                None, error_reward, "Invalid format: start with <think>...</think>, then answer."
            )
        rest = m.group(2).strip()
        if not rest:
            return ParseResult(None, error_reward, "Invalid format: nothing after </think>.")
        return ParseResult(rest, success_reward, None)

    return parse


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced braces


def boxed_parser(success_reward: float = 0.0, error_reward: float = -1.0) -> Parser:
    """Extract the content of the last ``\\boxed{...}`` (nested braces allowed)."""

    def parse(text: str) -> ParseResult:
        got = _last_boxed(text)
        if got is None:
            return ParseResult(
                None, error_reward, "Invalid format: give the final answer as \\boxed{...}."
            )
        return ParseResult(got.strip(), success_reward, None)

    return parse


def regex_parser(
    pattern: str, group: int = 1, success_reward: float = 0.0, error_reward: float = -1.0
) -> Parser:
    """The ``group`` of the first match of ``pattern`` (``re.search``), e.g.
    ``r"^\\s*(-?\\d+)"`` for a leading integer, ``r"####\\s*(.+)"`` for GSM8K's answer."""
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"regex_parser pattern {pattern!r} is not a valid regex: {e}") from e
    if not 0 <= group <= rx.groups:
        raise ValueError(f"regex_parser group={group}: {pattern!r} has {rx.groups} group(s)")

    def parse(text: str) -> ParseResult:
        m = rx.search(text)
        if m is None or m.group(group) is None:
            return ParseResult(
                None, error_reward, f"Invalid format: the reply must match {pattern}."
            )
        return ParseResult(m.group(group).strip(), success_reward, None)

    return parse


def compose_parsers(*parsers: Parser) -> Parser:
    """Chain parsers: each parses the previous one's action; rewards add up.

    The first failure stops the chain and returns its penalty (plus the rewards of the
    parsers that succeeded before it) and its feedback.
    """
    if not parsers:
        raise ValueError("compose_parsers needs at least one parser")

    def parse(text: str) -> ParseResult:
        total = 0.0
        current = text
        for p in parsers:
            r = p(current)
            total += r.reward
            if r.action is None:
                return ParseResult(None, total, r.obs)
            current = r.action
        return ParseResult(current, total, None)

    return parse


def identity() -> Parser:
    """The ``identity`` kind: :func:`identity_parser`."""
    return identity_parser


def compose(parsers: Sequence[ParserSpec]) -> Parser:
    """The ``compose`` kind: :func:`compose_parsers` over parser specs."""
    if isinstance(parsers, str | Mapping) or not isinstance(parsers, Sequence):
        raise ValueError(f"compose parsers={parsers!r} must be a list of parser specs")
    return compose_parsers(*[make_parser(p) for p in parsers])


ParserSpec = None | str | Mapping[str, Any]


def make_parser(spec: ParserSpec, where: str = "parser") -> Parser:
    """Build a parser from plain data (what crosses the wire in a ProtocolSpec).

    ``None`` (identity), a kind, or ``{kind, **kwargs}``: ``"boxed"``, ``{"kind": "xml",
    "tag": "move", "exact": false}``, ``{"kind": "regex", "pattern": "...", "group": 1}``,
    ``{"kind": "compose", "parsers": [spec, ...]}``. A kind is a registered name (entry-point
    group ``ludic.parsers``) or an import path ``pkg.mod:factory``; the factory is called
    with the kwargs and returns a Parser. Errors name ``where``, the value and the choices.
    """
    if spec is None:
        return identity_parser
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, Mapping) or "kind" not in spec:
        raise PluginError(
            f"{where}={spec!r} must be null, a kind name or a mapping with 'kind' (e.g. "
            "{kind: xml, tag: answer})"
        )
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    parser = plugins.build("parsers", spec["kind"], kwargs, where=f"{where}.kind")
    if not callable(parser):
        raise PluginError(
            f"{where}.kind={spec['kind']!r} returned {type(parser).__name__}, not a parser: a "
            "parser kind names a factory kind(**kwargs) -> Parser"
        )
    return cast(Parser, parser)
