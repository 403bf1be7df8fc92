"""Function calling in ``/v1/realtime`` on the tiny omni graph, with the official ``openai`` realtime client.

As in tests/test_chat_tools.py, the tiny thinker has random weights, so a call is forced where a test
needs one: ``tool_choice`` ``required`` or a named function (the hermes parser's structural tag, held
by xgrammar), or vLLM's ``structured_outputs`` regex for a reply of text then a call (through
``stage_sampling.thinker``, omni_serve's per-stage sampling extension). The continuation after a tool's
output is checked against a chat completion over the same history (``return_prompt_text``): the same
prompt, holding the call and the output in the model's syntax, and the same seeded reply.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.realtime_client import MODEL, decode_pcm, of
from tests.realtime_client import graph as graph  # the fixture: the same deployment, no redeploy
from tests.weather_tool import CALL, NO_WHITESPACE, SURE, WEATHER, literal

pytestmark = pytest.mark.integration

ASK = "What is the weather in Paris?"
TOOL = {"type": "function", **WEATHER["function"]}  # the Realtime API's flat function tool
FORCED = {"thinker": {"temperature": 0.0, "logit_bias": NO_WHITESPACE}}


async def _until(conn: Any, last: str, timeout: float = 300) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while True:
            seen.append(json.loads(await conn.recv_bytes()))
            if seen[-1]["type"] == last:
                return seen


def _ask(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_a_tool_round_trip_with_the_openai_realtime_client(graph) -> None:
    """``session.tools`` with a named ``tool_choice``: the response is one ``function_call`` item whose arguments
    stream, and nothing is spoken; the client sends the tool's output back as a ``function_call_output`` item
    and the next ``response.create`` continues from it, as a chat completion over the same history does."""
    from openai import AsyncOpenAI, OpenAI

    async def talk() -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        client = AsyncOpenAI(base_url=f"{graph.base_url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            await _until(conn, "session.created")
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {"input": {"turn_detection": None}},
                    "tools": [TOOL],  # type: ignore[list-item]
                    "tool_choice": {"type": "function", "name": "get_weather"},
                }
            )
            updated = (await _until(conn, "session.updated"))[-1]["session"]
            await conn.conversation.item.create(item=_ask(ASK))  # type: ignore[arg-type]
            await _until(conn, "conversation.item.done")
            await conn.response.create(
                response={"max_output_tokens": 120, "stage_sampling": FORCED}  # type: ignore[typeddict-unknown-key]
            )
            called = await _until(conn, "response.done")
            (call,) = called[-1]["response"]["output"]
            output = {"type": "function_call_output", "call_id": call["call_id"], "output": "21 degrees, sunny"}
            await conn.conversation.item.create(item=output)  # type: ignore[arg-type]
            added = await _until(conn, "conversation.item.done")
            await conn.response.create(
                response={
                    "output_modalities": ["text"],
                    "tool_choice": "auto",
                    "max_output_tokens": 6,
                    "seed": 3,  # type: ignore[typeddict-unknown-key]
                }
            )
            return updated, called, added, await _until(conn, "response.done")

    session, called, added, answered = asyncio.run(talk())
    assert session["tools"] == [TOOL] and session["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert called[-1]["response"]["status"] == "completed", called[-1]
    (item,) = [e["item"] for e in of(called, "response.output_item.added")]  # no message item: nothing said
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["call_id"]
    deltas = of(called, "response.function_call_arguments.delta")
    (done,) = of(called, "response.function_call_arguments.done")
    assert deltas and all(d["item_id"] == item["id"] and d["call_id"] == item["call_id"] for d in deltas)
    assert "".join(d["delta"] for d in deltas) == done["arguments"]
    assert (done["name"], done["call_id"], done["output_index"]) == ("get_weather", item["call_id"], 0)
    assert json.loads(done["arguments"])["unit"] in ("c", "f")
    assert not of(called, "response.output_audio.delta") and not of(called, "response.content_part.added")
    (finished,) = [e["item"] for e in of(called, "response.output_item.done")]
    assert finished == {**item, "status": "completed", "arguments": done["arguments"]}
    assert [e["item"]["id"] for e in of(called, "conversation.item.added")][-1] == item["id"]

    (output_item,) = [e["item"] for e in of(added, "conversation.item.added")]
    assert output_item["type"] == "function_call_output" and output_item["call_id"] == item["call_id"]
    length = {"type": "incomplete", "reason": "max_output_tokens"}  # 6 tokens: the tiny thinker rarely stops sooner
    assert answered[-1]["response"]["status"] == "completed" or answered[-1]["response"]["status_details"] == length
    said = "".join(e["delta"] for e in of(answered, "response.output_text.delta"))
    assert said and not of(answered, "response.function_call_arguments.delta")
    client = OpenAI(base_url=f"{graph.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    history = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": done["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": item["call_id"], "content": "21 degrees, sunny"},
    ]
    reference = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        modalities=["text"],
        seed=3,
        max_completion_tokens=6,
        extra_body={"return_prompt_text": True},
    )
    prompt = reference.model_extra["prompt_text"]  # type: ignore[index]
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(json.loads(done["arguments"]))}}}' in prompt
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in prompt
    usage = answered[-1]["response"]["usage"]
    assert usage["input_tokens"] == reference.usage.prompt_tokens, (usage, reference.usage)  # type: ignore[union-attr]
    assert said == reference.choices[0].message.content


def test_a_response_with_text_and_a_call_speaks_only_the_text(graph) -> None:
    """The audio of "Sure. <call>" is the audio of "Sure. " alone, sample for sample (same seed): the talker never
    got the call. The call is the response's second output item, after the spoken message."""
    from openai import AsyncOpenAI

    async def respond(thinker: dict[str, Any]) -> list[dict[str, Any]]:
        client = AsyncOpenAI(base_url=f"{graph.base_url}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            await _until(conn, "session.created")
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": None}}, "tools": [TOOL]}  # type: ignore[list-item]
            )
            await _until(conn, "session.updated")
            await conn.conversation.item.create(item=_ask(ASK))  # type: ignore[arg-type]
            await _until(conn, "conversation.item.done")
            sampling = {"thinker": {"temperature": 0.0, **thinker}, "talker": {"max_tokens": 12}}
            await conn.response.create(
                response={
                    "output_modalities": ["audio"],
                    "max_output_tokens": 120,
                    "seed": 11,  # type: ignore[typeddict-unknown-key]
                    "stage_sampling": sampling,
                }
            )
            return await _until(conn, "response.done")

    both = asyncio.run(respond(literal(SURE + CALL)))
    text = asyncio.run(respond(literal(SURE)))
    message, call = both[-1]["response"]["output"]
    assert message["type"] == "message" and message["content"][0]["transcript"] == SURE
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call",
        "get_weather",
        {"unit": "c"},
    )
    assert [e["output_index"] for e in of(both, "response.output_item.added")] == [0, 1]
    assert all(e["output_index"] == 0 for e in of(both, "response.output_audio.delta"))
    (alone,) = text[-1]["response"]["output"]
    assert alone["content"][0]["transcript"] == SURE
    spoken = decode_pcm([e["delta"] for e in of(both, "response.output_audio.delta")])
    reference = decode_pcm([e["delta"] for e in of(text, "response.output_audio.delta")])
    assert spoken.size > 0 and abs(spoken).max() > 0
    assert spoken.tolist() == reference.tolist()
