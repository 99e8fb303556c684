"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``: checked, and turned
into what generation needs (vLLM's behaviour):

- "none": the model answers in text; the tools are not shown to it.
- "auto": the tools go to the chat template; the server's tool-call parser reads calls out of
  the model's text (``--tool-call-parser``; without one, "auto" is a 400).
- "required": the output is forced, through the grammar, to a JSON array of
  ``{"name": <a tool>, "parameters": <valid under its schema>}`` (one item at most when
  parallel_tool_calls is false).
- a named function: the output is forced to that function's arguments, valid under its schema.

A function's ``strict`` (a boolean or null) changes nothing: forced calls always follow the
schema through the grammar, "auto" calls never do (constraints.py says the same of
``json_schema.strict``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jaxserve.entrypoints.openai.protocol.errors import OpenAIError, short_repr

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ToolChoice:
    """The checked tools of a request and how they are to be used.

    mode: "none", "auto", "required" or "named".
    tools: the request's tools, as OpenAI writes them ({"type": "function", "function": ...}).
    named: the function a "named" choice forces; None otherwise.
    parallel: several calls may come in one answer.
    """

    mode: str
    tools: tuple[dict[str, Any], ...]
    named: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template is told (none for "none")."""
        return None if self.mode == "none" else list(self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    def constraint(self) -> dict[str, Any] | None:
        """The structured_outputs that "required" or a named function force; None else."""
        if self.mode == "named":
            return {"json": self.parameters(self.named)}
        if self.mode != "required":
            return None
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": self.parameters(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema}


def tool_choice_of(request: Any) -> ToolChoice | None:
    """The request's ToolChoice; None without tools (and a tool_choice of "none" or absent).

    Raises:
        OpenAIError (400): malformed tools, a tool_choice without tools or naming no tool.
    """
    tools, choice = request.tools, request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError(f"tool_choice={short_repr(choice)} needs tools", param="tool_choice")
        return None
    checked = _check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    parallel = request.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if choice in ("none", "auto", "required"):
        return ToolChoice(choice, checked, None, parallel)
    named = _named(choice)
    if named not in names:
        raise OpenAIError(
            f"tool_choice names the function {named!r}, which is not among the tools {names}",
            param="tool_choice",
        )
    return ToolChoice("named", checked, named, parallel)


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise OpenAIError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {short_repr(choice)}',
            param="tool_choice",
        )
    return function["name"]


def _check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise OpenAIError(
            f"tools must be a list of at most {MAX_TOOLS} tools, got {short_repr(tools)}",
            param="tools",
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or set(tool) != {"type", "function"}
            or not isinstance(function, dict)
        ):
            raise OpenAIError(
                f'{where} must be {{"type": "function", "function": {{...}}}}, got '
                f"{short_repr(tool)}",
                param=where,
            )
        unknown = sorted(set(function) - _FUNCTION_KEYS)
        if unknown:
            raise OpenAIError(f"{where}.function: unknown field(s) {unknown}", param=where)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in seen:
            raise OpenAIError(
                f"{where}.function.name must be a unique name of 1 to 64 letters, digits, _ "
                f"or -, got {short_repr(name)}",
                param=f"{where}.function.name",
            )
        seen.add(name)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise OpenAIError(
                f"{where}.function.strict must be a boolean, got {short_repr(strict)}",
                param=f"{where}.function.strict",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise OpenAIError(
                f"{where}.function.parameters must be a JSON schema object, got "
                f"{short_repr(parameters)}",
                param=f"{where}.function.parameters",
            )
    return tuple(tools)
