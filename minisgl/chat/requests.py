"""Request fields -> what to render, what to constrain, how to parse the reply.

`plan_tools` checks `tools` / `tool_choice` / `parallel_tool_calls`; `constraint_from_fields`
turns the structured-output fields (`response_format`, SGLang's and vLLM's) into one
`Constraint`. A broken rule is an `InvalidRequestError` naming the field (a 400).
"""

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import minisgl.chat.jsontext as jsontext
from minisgl.chat.tool_parsers import HERMES_END, HERMES_START
from minisgl.core import Constraint
from minisgl.limits import MAX_TOOLS, InvalidRequestError

ToolMode = Literal["none", "auto", "named", "required"]


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # what the chat template gets as `tools`
    mode: ToolMode
    function: str | None = None  # mode "named": the function
    constraint: Constraint | None = None  # "named", "required", and "auto" in the default format
    max_calls: int | None = None  # parallel_tool_calls=false: 1


def _check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool; raises for any malformed tool."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidRequestError("tools", f"tool {i} must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError("tools", f"tool {i} has no 'function' object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("tools", f"tool {i} has no function name")
        if name in schemas:
            raise InvalidRequestError("tools", f"function name {name!r} is given twice")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(
                "tools", f"function {name!r}: parameters must be a JSON schema object"
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError("tools", f"function {name!r}: description must be a string")
        schemas[name] = dict(parameters)
    return schemas


def _choice(tool_choice: Any, names: list[str]) -> tuple[ToolMode, str | None]:
    if tool_choice in (None, "none", "auto", "required"):
        return tool_choice or "auto", None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            if name not in names:
                raise InvalidRequestError(
                    "tool_choice", f"function {name!r} is not one of the tools {names}"
                )
            return "named", name
    raise InvalidRequestError(
        "tool_choice",
        "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
    )


def _call_blocks(schemas: dict[str, dict[str, Any]], max_calls: int | None) -> Constraint:
    """Text, and `<tool_call>` blocks that each hold a valid call (xgrammar's structural tag:
    the grammar applies from the trigger on)."""
    tags = [
        {
            "type": "tag",
            "begin": f'{HERMES_START}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": params},
            "end": "}\n" + HERMES_END,
        }
        for name, params in schemas.items()
    ]
    tagged = {
        "type": "triggered_tags",
        "triggers": [HERMES_START],
        "tags": tags,
        "stop_after_first": max_calls == 1,
    }
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": tagged}))


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    default_format: bool = False,
) -> ToolPlan:
    """The plan for a request's tools. tool_choice naming a function or "required" is enforced
    by a grammar, as vLLM does it: the reply is the arguments object, or a JSON array of
    {"name", "parameters"} calls. `default_format` (no tool-call parser fits the template):
    "auto" lets the model write text or `<tool_call>` blocks, each one a valid call."""
    if not tools:  # None or [] (the Agents SDK sends [] for an agent without tools): no tools
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return ToolPlan(None, "none")
    schemas = _check_tools(tools)
    mode, function = _choice(tool_choice, list(schemas))
    if mode == "none":
        return ToolPlan(None, "none")  # the model is not told about tools it may not call
    max_calls = None if parallel_tool_calls else 1
    if mode == "auto":  # free text; in the default format every call block under a grammar
        constraint = _call_blocks(schemas, max_calls) if default_format else None
    elif function is not None:  # mode "named": the reply is its arguments
        constraint = Constraint("json_schema", json.dumps(schemas[function]))
    else:  # "required": a JSON array of {"name", "parameters"} calls
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if max_calls is not None:
            array["maxItems"] = max_calls
        constraint = Constraint("json_schema", json.dumps(array))
    return ToolPlan([dict(tool) for tool in tools], mode, function, constraint, max_calls)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object, a boolean or JSON text -> JSON text."""
    if isinstance(value, str):
        value = jsontext.loads(value, param, "the JSON schema is not valid JSON")
    if not isinstance(value, (Mapping, bool)):
        raise InvalidRequestError(param, "must be a JSON schema (an object)")
    return json.dumps(value)


def _choice_grammar(choices: Any, param: str) -> str:
    """guided_choice: the reply is exactly one of these strings (an EBNF alternation)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError(param, "must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(param, "must be a non-empty string")
    return value


def _response_format(value: Mapping[str, Any], param: str) -> Constraint | None:
    """(An object: the request's schema says so.)"""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise InvalidRequestError(param, "json_schema must be an object with a 'schema'")
        if (name := spec.get("name")) is not None and not isinstance(name, str):
            raise InvalidRequestError(param, "json_schema.name must be a string")
        return Constraint("json_schema", _schema_text(spec["schema"], param))
    message = f"type must be 'text', 'json_object' or 'json_schema', not {kind!r}"
    raise InvalidRequestError(param, message)


def _structured_outputs(value: Mapping[str, Any], param: str) -> Constraint | None:
    """vLLM's `structured_outputs` (an object: the request's schema says so): one of its keys,
    read as the guided_* field it stands for."""
    given = [key for key in ("json", "regex", "grammar", "choice", "json_object") if value.get(key)]
    if len(given) > 1:
        raise InvalidRequestError(param, f"give one of json, regex, grammar, choice; got {given}")
    if not given:
        return None
    key = given[0]
    if key == "json_object":
        return Constraint("json_object")
    try:
        return _FIELDS[f"guided_{key}"](value[key], param)
    except InvalidRequestError as exc:
        raise InvalidRequestError(param, f"{key} {exc.message}") from None


def _as(kind: str, check: Callable[[Any, str], str]) -> Callable[[Any, str], Constraint]:
    return lambda value, param: Constraint(kind, check(value, param))


# Each structured-output field: how its value (and the field's name) becomes a Constraint.
_FIELDS: dict[str, Callable[[Any, str], Constraint | None]] = {
    "response_format": _response_format,
    "regex": _as("regex", _text),
    "ebnf": _as("ebnf", _text),
    "json_schema": _as("json_schema", _schema_text),
    "guided_json": _as("json_schema", _schema_text),
    "guided_regex": _as("regex", _text),
    "guided_grammar": _as("ebnf", _text),
    "guided_choice": _as("ebnf", _choice_grammar),
    "structured_outputs": _structured_outputs,
}
CONSTRAINT_FIELDS = tuple(_FIELDS)  # the request fields that ask for a constraint


def constraint_from_fields(fields: Mapping[str, Any]) -> tuple[str, Constraint] | None:
    """(the field it came from, the constraint) for the structured-output fields that are set;
    None when none asks for one. More than one: an error."""
    asked = [(name, value) for name in _FIELDS if (value := fields.get(name)) is not None]
    found = [(name, c) for name, value in asked if (c := _FIELDS[name](value, name)) is not None]
    if len(found) > 1:
        names = [name for name, _ in found]
        message = f"only one structured-output constraint per request; got {names}"
        raise InvalidRequestError(found[1][0], message)
    return found[0] if found else None
