"""Chat messages as a checkpoint's chat template takes them: any model's, so no model is named here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_serve.types import ChatMessage, TextPart


def template_fields(message: ChatMessage) -> dict[str, Any]:
    """A turn's tool fields as the chat template takes them (an assistant's calls, a tool result's call id)."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        fields["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    return fields


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Chat turns as the chat template takes them: text, and one ``{"type": kind}`` per media part (the template
    writes the model's placeholder for it); an assistant turn's tool calls and a tool result's call id."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m.content, str):
            turns.append({"role": m.role, "content": m.content, **template_fields(m)})
        else:
            parts = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": p.type} for p in m.content
            ]
            turns.append({"role": m.role, "content": parts, **template_fields(m)})
    return turns
