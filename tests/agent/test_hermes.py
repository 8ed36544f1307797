"""The hermes tool-call parser: round-trips of any calls and surrounding text (hypothesis), and each malformed
block becoming a ToolCallError instead of an exception."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindrl.agent.hermes import END, START, ToolCall, format_tool_call, parse_tool_calls

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
calls = st.builds(
    ToolCall,
    name=st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=20),
    arguments=st.dictionaries(st.text(), json_values, max_size=4),
)
# Text between calls: anything that does not itself open or close a block.
prose = st.text().filter(lambda t: START not in t and END not in t and not t.endswith("<tool_call"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(prose, calls), max_size=4), prose)
def test_calls_round_trip_through_text(pieces, tail):
    text = "".join(p + format_tool_call(c) for p, c in pieces) + tail
    parsed = parse_tool_calls(text)
    assert parsed.errors == []
    assert parsed.calls == [c for _, c in pieces]


@settings(max_examples=200, deadline=None)
@given(prose)
def test_text_without_calls_parses_to_nothing(text):
    parsed = parse_tool_calls(text)
    assert not parsed.any


@settings(max_examples=100, deadline=None)
@given(st.lists(calls, min_size=1, max_size=3), st.integers(0, 2))
def test_a_malformed_block_is_reported_in_place_and_the_others_still_parse(good, at):
    at = min(at, len(good))
    blocks = [format_tool_call(c) for c in good]
    blocks.insert(at, f"{START}not json{END}")
    parsed = parse_tool_calls(" ".join(blocks))
    assert parsed.calls == good
    assert len(parsed.errors) == 1 and parsed.errors[0].text == "not json"


@pytest.mark.parametrize(
    "body, reason",
    [
        ("{", "not JSON"),
        ("[1, 2]", "a tool call is a JSON object, got list"),
        ('{"arguments": {}}', 'no "name" string'),
        ('{"name": "", "arguments": {}}', 'no "name" string'),
        ('{"name": "f", "arguments": [1]}', '"arguments" must be a JSON object, got list'),
        ('{"name": "f", "arguments": "{oops"}', '"arguments" is a string that is not JSON'),
    ],
)
def test_malformed_calls_say_what_is_wrong(body, reason):
    parsed = parse_tool_calls(f"x {START}{body}{END} y")
    assert parsed.calls == []
    assert len(parsed.errors) == 1 and parsed.errors[0].reason.startswith(reason)


def test_arguments_as_a_json_string_are_accepted():
    parsed = parse_tool_calls(f'{START}{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}{END}')
    assert parsed.calls == [ToolCall("f", {"a": 1})]


def test_missing_arguments_mean_no_arguments():
    assert parse_tool_calls(f'{START}{{"name": "f"}}{END}').calls == [ToolCall("f", {})]


def test_an_unclosed_block_after_good_ones_is_an_error():
    good = ToolCall("f", {"x": 1})
    parsed = parse_tool_calls(format_tool_call(good) + f' then {START}{{"name": "g", "argu')
    assert parsed.calls == [good]
    assert [e.reason for e in parsed.errors] == [f"{START} without {END}"]
    assert parsed.errors[0].text.startswith('{"name": "g"')


def test_an_argument_holding_the_end_tag_stays_one_call():
    """Code that prints "</tool_call>" must not cut its own call short (a regex up to the first end tag does)."""
    call = ToolCall("code_interpreter", {"code": f"print('{END}')"})
    assert parse_tool_calls(format_tool_call(call)).calls == [call]


def test_text_after_the_json_inside_a_block_is_an_error():
    parsed = parse_tool_calls(f'{START}{{"name": "f", "arguments": {{}}}} extra{END}')
    assert parsed.calls == [] and parsed.errors[0].reason.startswith("text after the JSON object")
