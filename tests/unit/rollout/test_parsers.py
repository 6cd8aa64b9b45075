import pytest

from libludic.parsers import (
    ParseResult,
    boxed_parser,
    compose_parsers,
    identity_parser,
    make_parser,
    think_prefix_parser,
    xml_parser,
)


def test_xml_parser_takes_last_element_and_success_reward():
    p = xml_parser("move", success_reward=0.1, error_reward=-1.0)
    assert p("I think <move>3</move> no, <move> 5 </move>") == ParseResult("5", 0.1, None)


def test_xml_parser_missing_tag_gives_penalty_and_feedback():
    r = xml_parser("move", error_reward=-0.5)("just 5")
    assert r.action is None and r.reward == -0.5 and "<move>" in (r.obs or "")


def test_xml_parser_exact_rejects_surrounding_text():
    p = xml_parser("answer", exact=True)
    assert p("  <answer>42</answer>\n").action == "42"
    assert p("so <answer>42</answer>").action is None
    assert p("<answer>1</answer><answer>2</answer>").action is None


def test_xml_parser_rejects_bad_tag_name():
    with pytest.raises(ValueError, match="valid XML tag"):
        xml_parser("a b")


def test_think_prefix_parser():
    p = think_prefix_parser(success_reward=0.2)
    assert p("<think>hmm</think> 7") == ParseResult("7", 0.2, None)
    assert p("7 <think>x</think>").action is None
    assert p("<think>x</think>   ").action is None


def test_boxed_parser_handles_nested_braces_and_last_box():
    p = boxed_parser()
    assert p(r"first \boxed{1} then \boxed{\frac{1}{2}}").action == r"\frac{1}{2}"
    assert p(r"\boxed{unclosed").action is None
    assert p("no box").reward == -1.0


def test_compose_parsers_sums_rewards_and_stops_at_first_failure():
    p = compose_parsers(
        think_prefix_parser(success_reward=0.1), xml_parser("answer", success_reward=0.2)
    )
    ok = p("<think>a</think><answer>9</answer>")
    assert ok.action == "9" and ok.reward == pytest.approx(0.3)
    bad = p("<think>a</think> 9")
    # think succeeded (+0.1), xml failed (-1.0): 0.1 - 1.0 = -0.9
    assert bad.action is None and bad.reward == pytest.approx(-0.9)


def test_compose_parsers_needs_parsers():
    with pytest.raises(ValueError):
        compose_parsers()


def test_make_parser_from_plain_data():
    assert make_parser(None) is identity_parser
    assert make_parser({"kind": "xml", "tag": "move"})("<move>2</move>").action == "2"
    assert make_parser("boxed")(r"\boxed{4}").action == "4"
    comp = make_parser({"kind": "compose", "parsers": ["think", {"kind": "xml", "tag": "a"}]})
    assert comp("<think>x</think><a>1</a>").action == "1"
    with pytest.raises(
        ValueError, match=r"parser.kind='nope' is unknown; registered: \[boxed, compose, identity"
    ):
        make_parser({"kind": "nope"})
