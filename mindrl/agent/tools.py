"""The tool interface the agent loop calls, the tools mindrl ships, and the tool YAML (MindSpeed-RL's
`tool_config_path`: a `tools:` list of `class_name`, `config` and an OpenAI-function `tool_schema`).

A tool is built once per run from its YAML entry and called from several threads at once (the agent loop runs a
turn's calls, and every trajectory's, in a thread pool): `execute` must be thread-safe. The loop checks the
arguments against the entry's `parameters` JSON Schema before calling, so `execute` sees only arguments of that
shape."""

from __future__ import annotations

import abc
import ast
import math
import operator
import re
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import jsonschema
import yaml


class ToolError(Exception):
    """A failure the model is shown as the call's observation (bad input, a failed run), not a crash."""


class ToolConfigError(ValueError):
    """The tool YAML is wrong; the message names the file and each bad entry."""


class Tool(abc.ABC):
    """One callable tool. `CONFIG_KEYS`: the keys its YAML `config` may hold (any other is an error at load)."""

    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]) -> None:
        unknown = sorted(set(config) - self.CONFIG_KEYS)
        if unknown:
            allowed = ", ".join(sorted(self.CONFIG_KEYS)) or "none"
            raise ValueError(f"config: unknown key(s) {unknown} for {type(self).__name__} (allowed: {allowed})")
        self.config = config
        self.schema = schema
        self.name: str = schema["function"]["name"]
        self.parameters: dict[str, Any] = schema["function"].get("parameters") or {"type": "object"}
        self._args_validator = jsonschema.validators.validator_for(self.parameters)(self.parameters)

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema's `parameters` (the first problem), or None."""
        error = jsonschema.exceptions.best_match(self._args_validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{where + ': ' if where else ''}{error.message}"

    @abc.abstractmethod
    def execute(self, arguments: dict[str, Any]) -> str:
        """The observation text for one call; raises `ToolError` for a failure the model should see."""


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorTool(Tool):
    """Arithmetic on integers and decimals (+ - * / // % ** and parentheses), evaluated from Python's AST without
    `eval`: no names, calls or attributes, so model text cannot reach anything but numbers. Integers stay exact;
    `max_digits` bounds every intermediate integer (and `**`'s exponent is bounded) so a call cannot eat the
    driver's memory or time. Arguments: `{"expression": str}`."""

    CONFIG_KEYS = frozenset({"max_digits"})
    DEFAULT_MAX_DIGITS = 100

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]) -> None:
        super().__init__(config, schema)
        self.max_digits = config.get("max_digits", self.DEFAULT_MAX_DIGITS)
        if not isinstance(self.max_digits, int) or isinstance(self.max_digits, bool) or self.max_digits < 1:
            raise ValueError(f"config.max_digits: must be an integer >= 1, got {self.max_digits!r}")

    def _bounded(self, v):
        if isinstance(v, int) and len(str(abs(v))) > self.max_digits:
            raise ToolError(f"a result has more than {self.max_digits} digits")
        return v

    def _eval(self, node: ast.AST):
        if isinstance(node, ast.Expression):
            return self._eval(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self._eval(node.left), self._eval(node.right)
            if (
                isinstance(node.op, ast.Pow)
                and isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right * math.log10(abs(left)) > self.max_digits
            ):
                raise ToolError(f"a result has more than {self.max_digits} digits")
            try:
                return self._bounded(_BINOPS[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("a result is too large") from None
        raise ToolError(f"unsupported syntax: {ast.dump(node)[:60]}")

    def execute(self, arguments: dict[str, Any]) -> str:
        expression = arguments["expression"]
        if len(expression) > 10 * self.max_digits:
            raise ToolError(f"expression longer than {10 * self.max_digits} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as e:
            raise ToolError(f"not an arithmetic expression: {e.msg}") from None
        result = self._eval(tree)
        if isinstance(result, complex):
            raise ToolError("the result is not a real number")
        return str(result)


class CodeTool(Tool):
    """Runs the model's Python on a SandboxFusion-compatible `/run_code` endpoint (`sandbox_fusion_url`: a real
    SandboxFusion deployment, or `mindrl-sandbox --serve`). The observation is the run's stdout (and stderr, if any);
    a run that fails (an exception, a limit hit) or a sandbox that does not answer is a failed call the model sees.
    MindSpeed-RL's ReTool keys: `default_timeout` (run seconds), `memory_limit_mb`, `default_language`; `rate_limit`
    bounds the calls in flight (`enable_global_rate_limit: false`: no bound); `num_workers` and `type` are read and
    have no effect (the agent loop's thread pool runs the calls). Arguments: `{"code": str}`."""

    CONFIG_KEYS = frozenset({"sandbox_fusion_url", "num_workers", "enable_global_rate_limit", "rate_limit",
                             "default_timeout", "default_language", "memory_limit_mb", "type"})  # fmt: skip

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]) -> None:
        super().__init__(config, schema)
        self.url = config.get("sandbox_fusion_url")
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"config.sandbox_fusion_url: an http(s) URL of a /run_code endpoint is required, "
                             f"got {self.url!r}")  # fmt: skip
        self.timeout = config.get("default_timeout", 30)
        self.memory_mb = config.get("memory_limit_mb", 1024)
        self.language = config.get("default_language", "python")
        for key, v in (("default_timeout", self.timeout), ("memory_limit_mb", self.memory_mb),
                       ("rate_limit", config.get("rate_limit", 1))):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"config.{key}: must be a positive number, got {v!r}")
        limited = config.get("enable_global_rate_limit", True)
        self.slots = threading.BoundedSemaphore(int(config.get("rate_limit", 64))) if limited else None

    def execute(self, arguments: dict[str, Any]) -> str:
        import requests

        body = {"code": arguments["code"], "language": self.language, "run_timeout": self.timeout,
                "memory_limit_MB": self.memory_mb}  # fmt: skip
        if self.slots is not None:
            self.slots.acquire()
        try:
            resp = requests.post(self.url, json=body, timeout=self.timeout + 30)
            out = resp.json()
        except (requests.RequestException, ValueError) as e:
            raise ToolError(f"the code sandbox at {self.url} did not answer: {type(e).__name__}") from None
        finally:
            if self.slots is not None:
                self.slots.release()
        run = out.get("run_result") or {}
        text = (run.get("stdout") or "") + (run.get("stderr") or "")
        if out.get("status") == "Success":
            return text or "(no output)"
        if run.get("status") == "TimeLimitExceeded":
            raise ToolError(f"time limit exceeded ({self.timeout} s){': ' + text if text else ''}")
        raise ToolError(text or out.get("message") or f"the sandbox answered {out.get('status')!r}")


class SearchTool(Tool):
    """Searches a Search-R1-style retrieval endpoint (`retrieval_service_url`: `mindrl-retrieval`, or Search-R1's own
    retrieval server): POSTs `{"queries": query_list, "topk": topk, "return_scores": true}` and shows the model each
    query's documents as `Doc i (Title: ...)` followed by the text, queries separated by `---`, as MindSpeed-RL's
    search tool does. A service that does not answer within `timeout` seconds, an HTTP error or a body that is not
    the expected JSON is a failed call the model sees (no retries: a rollout waits on its slowest call).
    `rate_limit` bounds the calls in flight (`enable_global_rate_limit: false`: no bound); `num_workers` and `type`
    are read and have no effect. Arguments: `{"query_list": [str, ...]}`."""

    CONFIG_KEYS = frozenset({"retrieval_service_url", "topk", "timeout", "num_workers", "enable_global_rate_limit",
                             "rate_limit", "type"})  # fmt: skip

    def __init__(self, config: dict[str, Any], schema: dict[str, Any]) -> None:
        super().__init__(config, schema)
        self.url = config.get("retrieval_service_url")
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"config.retrieval_service_url: an http(s) URL of a /retrieve endpoint is required, "
                             f"got {self.url!r}")  # fmt: skip
        self.topk = config.get("topk", 3)
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or not 1 <= self.topk <= 100:
            raise ValueError(f"config.topk: must be an integer in 1..100, got {self.topk!r}")
        self.timeout = config.get("timeout", 30)
        for key, v in (("timeout", self.timeout), ("rate_limit", config.get("rate_limit", 1))):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"config.{key}: must be a positive number, got {v!r}")
        limited = config.get("enable_global_rate_limit", True)
        self.slots = threading.BoundedSemaphore(int(config.get("rate_limit", 120))) if limited else None

    def execute(self, arguments: dict[str, Any]) -> str:
        import requests

        queries = arguments.get("query_list")
        # MindSpeed-RL's schema spells `item` for `items`, so the loop's schema check lets any list through
        if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
            raise ToolError("'query_list' must be a non-empty list of non-empty strings")
        if self.slots is not None:
            self.slots.acquire()
        try:
            resp = requests.post(self.url, json={"queries": queries, "topk": self.topk, "return_scores": True},
                                 timeout=self.timeout)  # fmt: skip
            body = resp.json()
        except requests.Timeout:
            raise ToolError(f"the retrieval service at {self.url} did not answer within {self.timeout} s") from None
        except (requests.RequestException, ValueError) as e:
            raise ToolError(f"the retrieval service at {self.url} did not answer: {type(e).__name__}") from None
        finally:
            if self.slots is not None:
                self.slots.release()
        if resp.status_code != 200:
            why = body.get("error") or body.get("detail") if isinstance(body, dict) else None
            raise ToolError(f"the retrieval service answered HTTP {resp.status_code}{': ' + str(why) if why else ''}")
        results = body.get("result") if isinstance(body, dict) else None
        if not isinstance(results, list) or len(results) != len(queries):
            raise ToolError(f"the retrieval service answered no 'result' list of {len(queries)} queries' hits")
        try:
            blocks = [_passages(hits) for hits in results]
        except (TypeError, KeyError, AttributeError):
            raise ToolError("the retrieval service answered hits without document 'contents'") from None
        return "\n---\n".join(blocks)


def _passages(hits: list) -> str:
    """One query's hits (`{"document": row, "score": s}` or bare rows) as `Doc i (Title: first line)` + the rest."""
    if not hits:
        return "No search results found."
    docs = []
    for i, hit in enumerate(hits, 1):
        contents = (hit["document"] if "document" in hit else hit)["contents"]
        title, _, text = contents.partition("\n")
        docs.append(f"Doc {i} (Title: {title})\n{text}")
    return "\n\n".join(docs)


TOOL_CLASSES: dict[str, type[Tool]] = {
    "calculator": CalculatorTool,
    "mindrl.agent.tools.CalculatorTool": CalculatorTool,
    "code_interpreter": CodeTool,
    "mindrl.agent.tools.CodeTool": CodeTool,
    "mindspeed_rl.tools.retool.ReTool": CodeTool,
    "mindspeed_rl.tools.sandbox_fusion_tool.SandboxFusionTool": CodeTool,
    "search": SearchTool,
    "mindrl.agent.tools.SearchTool": SearchTool,
    "mindspeed_rl.tools.search_tool.SearchTool": SearchTool,
}
"""YAML class_name -> the tool class (MindSpeed-RL's code tools are mindrl's CodeTool, its search tool SearchTool)."""
NOT_YET: dict[str, str] = {}
"""MindSpeed-RL tool classes mindrl will map to its own tools once they exist: refused at load, saying which."""
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function-name rule


@dataclass(frozen=True)
class ToolSpec:
    class_name: str
    config: dict[str, Any]
    schema: dict[str, Any]


def _check_schema(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return f"tool_schema: must be a mapping, got {type(schema).__name__}"
    if schema.get("type") != "function":
        return f"tool_schema.type: must be 'function', got {schema.get('type')!r}"
    fn = schema.get("function")
    if not isinstance(fn, dict):
        return "tool_schema.function: must be a mapping with name, description and parameters"
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        return f"tool_schema.function.name: must be 1-64 letters, digits, '_' or '-', got {name!r}"
    if not isinstance(fn.get("description", ""), str):
        return "tool_schema.function.description: must be a string"
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("type") != "object":
            return "tool_schema.function.parameters: must be a JSON Schema of type 'object'"
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.exceptions.SchemaError as e:
            return f"tool_schema.function.parameters: not a valid JSON Schema: {e.message}"
        required = params.get("required", [])
        missing = [r for r in required if r not in params.get("properties", {})] if isinstance(required, list) else []
        if missing:
            return f"tool_schema.function.parameters.required: {missing} not in properties"
    return None


def load_tool_specs(path: str) -> list[ToolSpec]:
    """The `tools:` entries of the YAML at `path`, each checked; every problem is reported at once, naming the
    file and the entry (`tools[i]`, with its function name where it has one)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ToolConfigError(f"{path}: cannot read the tool config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or not data["tools"]:
        raise ToolConfigError(f"{path}: must hold a non-empty 'tools:' list")
    problems, specs, names = [], [], {}
    for i, entry in enumerate(data["tools"]):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: must be a mapping with class_name, config and tool_schema")
            continue
        fn = entry.get("tool_schema", {}).get("function", {}) if isinstance(entry.get("tool_schema"), dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            where += f" ({fn['name']})"
        unknown = sorted(set(entry) - {"class_name", "config", "tool_schema"})
        if unknown:
            problems.append(f"{where}: unknown key(s) {unknown} (an entry has class_name, config, tool_schema)")
        cls_name, config = entry.get("class_name"), entry.get("config") or {}
        if cls_name in NOT_YET:
            problems.append(f"{where}: class_name {cls_name!r} is {NOT_YET[cls_name]}, which mindrl does not ship yet")
        elif cls_name not in TOOL_CLASSES:
            problems.append(f"{where}: class_name {cls_name!r} is not a mindrl tool (known: {sorted(TOOL_CLASSES)})")
        if not isinstance(config, dict):
            problems.append(f"{where}: config must be a mapping, got {type(config).__name__}")
        bad = _check_schema(entry.get("tool_schema"))
        if bad:
            problems.append(f"{where}: {bad}")
        elif fn["name"] in names:
            problems.append(f"{where}: the function name {fn['name']!r} is also tools[{names[fn['name']]}]'s")
        else:
            names[fn["name"]] = i
            specs.append(ToolSpec(cls_name, dict(config) if isinstance(config, dict) else {}, entry["tool_schema"]))
    if problems:
        raise ToolConfigError("\n".join(problems))
    return specs


def build_tools(path: str) -> dict[str, Tool]:
    """The tools of the YAML at `path`, by function name; a tool whose config it rejects is reported like a bad
    entry."""
    tools, problems = {}, []
    for i, spec in enumerate(load_tool_specs(path)):
        name = spec.schema["function"]["name"]
        try:
            tools[name] = TOOL_CLASSES[spec.class_name](spec.config, spec.schema)
        except ValueError as e:
            problems.append(f"{path}: tools[{i}] ({name}): {e}")
    if problems:
        raise ToolConfigError("\n".join(problems))
    return tools
