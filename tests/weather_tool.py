"""The weather tool, the tiny thinker's call of it, and forcing a reply text through logit bias."""

from __future__ import annotations

import re
from typing import Any

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


NO_WHITESPACE = {"9": -100, "10": -100, "13": -100, "32": -100}  # tab, newline, carriage return, space


SURE = "Sure. "


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'


def literal(text: str) -> dict[str, Any]:
    """vLLM's structured_outputs forcing exactly ``text`` (xgrammar's regex dialect: its metacharacters escaped)."""
    return {"structured_outputs": {"regex": re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)}}
