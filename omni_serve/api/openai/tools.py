"""Chat's tool calling as clients send it (``tools``, ``tool_choice``, calls in the history) and as replies carry it.

The entry stage parses the calls out of its own output (:mod:`omni_serve.models.tool_calls`); here are
only the request's shapes, checked before any stage runs, and the reply's: a non-streamed message's
``tool_calls``, a streamed chunk's ``delta.tool_calls``. Function tools only: OpenAI's custom tools
(free-form input) and ``allowed_tools`` choices are refused, naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from omni_serve.api.openai.errors import bad_request
from omni_serve.api.openai.messages import _Strict
from omni_serve.types import ToolCallDelta, ToolCalling

# OpenAI's limits: a request offers at most 128 functions, each name 1-64 of these characters.
MAX_TOOLS = 128
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME, description="The function's name (letters, digits, _ and -, 1-64).")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema; none: no arguments.")
    strict: bool | None = Field(
        None, description="Constrain a call's arguments to the schema (vLLM's structural tag; always so when forced)."
    )


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") == "custom":
            raise ValueError("type: custom tools are not supported; describe the tool as a function")
        return value


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") in ("allowed_tools", "custom"):
            raise ValueError(f"'{value['type']}' choices are not supported; name one function, or say auto or required")
        return value


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_calling(tools: list[FunctionTool] | None, choice: Any, parallel: bool | None) -> ToolCalling | None:
    """What the entry stage gets of the request's tools (None: it offers none); a 400 naming the field for a
    choice that names no tool."""
    names = [t.function.name for t in tools or []]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: two functions are named '{duplicate}'", "tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        param = "tool_choice.function.name"
        raise bad_request(f"{param}: '{choice.function.name}' is not one of the tools ({', '.join(names)})", param)
    if choice not in (None, "none") and not tools:
        raise bad_request("tool_choice: there are no tools to choose from", "tool_choice")
    if not tools:
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return ToolCalling(
        tools=[template_tool(t) for t in tools],
        choice="auto" if named is not None or choice is None else choice,
        function=named,
        parallel=parallel is not False,
    )


def template_tool(tool: FunctionTool) -> dict[str, Any]:
    """A tool as the chat template gets it: vLLM's dump of it (``description`` and ``parameters`` always, null
    when not given; ``strict`` only when given), so a prompt with tools is the one ``vllm serve`` renders."""
    function = tool.function
    dumped: dict[str, Any] = {"name": function.name, "description": function.description}
    dumped["parameters"] = function.parameters
    if function.strict is not None:
        dumped["strict"] = function.strict
    return {"type": "function", "function": dumped}


# ---- the reply ------------------------------------------------------------------------------


def delta_json(piece: ToolCallDelta) -> dict[str, Any]:
    """One piece of a call as a streamed chunk's ``delta.tool_calls`` entry: id, type and name with the first."""
    body: dict[str, Any] = {"index": piece.index}
    function: dict[str, Any] = {}
    if piece.id is not None:
        body.update(id=piece.id, type="function")
    if piece.name is not None:
        function["name"] = piece.name
    function["arguments"] = piece.arguments
    body["function"] = function
    return body


def calls_json(pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """A reply's calls, whole, as a message's ``tool_calls`` (the pieces joined per call, in call order)."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        blank = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        call = calls.setdefault(piece.index, blank)
        if piece.id is not None:
            call["id"] = piece.id
        if piece.name is not None:
            call["function"]["name"] = piece.name
        call["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]
