"""A session's tools (``session.tools``, ``tool_choice``, ``parallel_tool_calls``, and their per-response
overrides in ``response.create``) as OpenAI's Realtime API shapes them, resolved by chat's own tool calling.

The Realtime API flattens a function tool (``{type, name, description, parameters}``) and a named
choice (``{type: "function", name}``) where chat nests them under ``function``; that is the only
difference. Each is turned into chat's model and resolved by :func:`omni_serve.api.openai.tools.tool_calling`
(the same checks, the same :class:`~omni_serve.types.ToolCalling` for the entry stage, whose tool
parser then forces and parses the calls as for a chat completion), its errors renamed to the
realtime field. MCP tools and choices are refused, naming them: omni_serve calls no tool itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.api.openai import tools as chat
from omni_serve.api.openai.errors import APIError, renamed
from omni_serve.types import ToolCalling


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: Literal["function"] = "function"
    name: str = Field(pattern=chat.FUNCTION_NAME, description="The function's name (letters, digits, _ and -, 1-64).")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON schema; none: no arguments.")

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") == "mcp":
            raise ValueError("type: mcp tools are not supported (omni_serve calls no tool itself); send functions")
        return value

    def chat_tool(self) -> chat.FunctionTool:
        return chat.FunctionTool(
            type="function",
            function=chat.FunctionDefinition(name=self.name, description=self.description, parameters=self.parameters),
        )


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") == "mcp":
            raise ValueError("mcp choices are not supported; name one function, or say auto or required")
        return value


ToolChoice = Literal["none", "auto", "required"] | NamedFunction
Tools = list[FunctionTool]
MAX_TOOLS = chat.MAX_TOOLS


def choice_json(choice: ToolChoice | None) -> Any:
    """``tool_choice`` as ``session.updated`` shows it (``auto`` when none was set, OpenAI's default)."""
    return choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto"


def tool_calling(tools: Tools, choice: ToolChoice | None, parallel: bool | None, prefix: str) -> ToolCalling | None:
    """What the entry stage gets of the tools (None: it offers none), checked as chat checks them; an error
    names the realtime field (``prefix`` is ``session.`` or ``response.``).

    ``auto`` with no tools is accepted (it is the session's default, and clients send it with an empty
    list); ``required`` or a named function with no tools is refused, as in chat."""
    named = None
    if isinstance(choice, NamedFunction):
        named = chat.NamedToolChoice(type="function", function=chat.NamedFunction(name=choice.name))
    try:
        return chat.tool_calling(
            [t.chat_tool() for t in tools] or None, named or (None if choice == "auto" else choice), parallel
        )
    except APIError as err:
        raise renamed(
            err, prefix + (err.param or "").replace("tool_choice.function.name", "tool_choice.name")
        ) from None
