"""The tool YAML (MindSpeed-RL's tool_config_path format): loading, and errors that name the file and the entry;
the calculator tool and the argument check against the schema."""

from __future__ import annotations

import re

import pytest
import yaml

from mindrl.agent.tools import CalculatorTool, ToolConfigError, ToolError, build_tools, load_tool_specs

CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}


def _write(tmp_path, tools) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": tools}))
    return str(path)


def _calc(**config):
    return CalculatorTool(config, CALC_SCHEMA)


def test_a_calculator_entry_builds_the_tool(tmp_path):
    path = _write(tmp_path, [{"class_name": "calculator", "config": {"max_digits": 30}, "tool_schema": CALC_SCHEMA}])
    tools = build_tools(path)
    assert list(tools) == ["calculator"] and tools["calculator"].max_digits == 30
    assert tools["calculator"].execute({"expression": "12*(3+4)"}) == "84"


def test_mindspeed_rls_retool_yaml_builds_the_code_tool(tmp_path):
    entry = {
        "class_name": "mindspeed_rl.tools.retool.ReTool",
        "config": {"sandbox_fusion_url": "http://localhost:8080/run_code", "num_workers": 128},
        "tool_schema": {
            "type": "function",
            "function": {
                "name": "code_interpreter",
                "description": "A tool for executing code.",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            },
        },
    }
    path = _write(tmp_path, [entry])
    tool = build_tools(path)["code_interpreter"]
    assert type(tool).__name__ == "CodeTool" and tool.url == "http://localhost:8080/run_code"
    entry["config"]["sandbox_fusion_url"] = "localhost:8080"
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \(code_interpreter\): config.sandbox_fusion_url"):
        build_tools(_write(tmp_path, [entry]))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda e: e.update(class_name="nope.Tool"), r"class_name 'nope.Tool' is not a mindrl tool"),
        (lambda e: e.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda e: e.update(config=[1]), "config must be a mapping"),
        (lambda e: e["tool_schema"].update(type="fn"), "tool_schema.type: must be 'function'"),
        (lambda e: e["tool_schema"]["function"].update(name="a b"), "tool_schema.function.name"),
        (
            lambda e: e["tool_schema"]["function"]["parameters"].update(type="array"),
            "parameters: must be a JSON Schema of type 'object'",
        ),
        (
            lambda e: e["tool_schema"]["function"]["parameters"].update(properties={"x": {"type": 5}}),
            "not a valid JSON Schema",
        ),
        (
            lambda e: e["tool_schema"]["function"]["parameters"].update(required=["expression", "y"]),
            r"required: \['y'\] not in properties",
        ),
    ],
)
def test_a_bad_entry_is_reported_with_file_and_entry(tmp_path, change, message):
    good = {"class_name": "calculator", "tool_schema": CALC_SCHEMA}
    bad = yaml.safe_load(yaml.safe_dump(good))
    change(bad)
    path = _write(tmp_path, [good, bad])
    with pytest.raises(ToolConfigError) as e:
        load_tool_specs(path)
    assert str(e.value).startswith(f"{path}: tools[1]")
    assert re.search(message, str(e.value)), str(e.value)


def test_every_problem_is_reported_at_once_and_duplicate_names_are_caught(tmp_path):
    entry = {"class_name": "calculator", "tool_schema": CALC_SCHEMA}
    path = _write(tmp_path, [entry, entry, {"class_name": "x", "tool_schema": CALC_SCHEMA}])
    with pytest.raises(ToolConfigError) as e:
        load_tool_specs(path)
    lines = str(e.value).splitlines()
    assert len(lines) == 3
    assert "tools[1] (calculator): the function name 'calculator' is also tools[0]'s" in lines[0]
    assert "tools[2] (calculator): class_name 'x'" in lines[1]
    assert "tools[2] (calculator): the function name" in lines[2]


def test_a_tool_config_key_the_tool_does_not_know_is_an_error(tmp_path):
    path = _write(tmp_path, [{"class_name": "calculator", "config": {"rate_limit": 4}, "tool_schema": CALC_SCHEMA}])
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \(calculator\): config: unknown key\(s\) \['rate_limit'\]"):
        build_tools(path)


@pytest.mark.parametrize(
    "text, message", [("", "cannot read"), ("tools: [", "not valid YAML"), ("tools: []", "non-empty")]
)
def test_unreadable_or_empty_files(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    if text:
        path.write_text(text)
    with pytest.raises(ToolConfigError, match=message) as e:
        load_tool_specs(str(path))
    assert str(e.value).startswith(str(path))


@pytest.mark.parametrize(
    "expression, result",
    [("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("7//2", "3"), ("-7%3", "2"), ("2**10", "1024"),
     ("123456789*987654321", "121932631112635269"), (" 1.5 + 1 ", "2.5")],
)  # fmt: skip
def test_calculator_arithmetic(expression, result):
    assert _calc().execute({"expression": expression}) == result


@pytest.mark.parametrize(
    "expression, message",
    [("1/0", "division by zero"), ("__import__('os')", "unsupported syntax"), ("x+1", "unsupported syntax"),
     ("1+", "not an arithmetic expression"), ("9**9**9", "more than 100 digits"), ("10**101", "more than 100 digits"),
     ("(-8)**0.5", "not a real number"), ("'a'*3", "unsupported syntax"), ("1.5**100000", "too large")],
)  # fmt: skip
def test_calculator_refuses_with_a_tool_error(expression, message):
    with pytest.raises(ToolError, match=message):
        _calc().execute({"expression": expression})


def test_arguments_are_checked_against_the_schema():
    calc = _calc()
    assert calc.check_arguments({"expression": "1"}) is None
    assert "'expression' is a required property" in calc.check_arguments({})
    assert calc.check_arguments({"expression": 5}).startswith("expression: 5 is not of type 'string'")
