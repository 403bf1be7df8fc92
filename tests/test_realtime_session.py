"""A realtime session's response lifecycle against a scripted graph (no Ray): every response ends with
``response.done``, whenever its cancel comes, and the session takes the next one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from omni_serve.api.realtime.session import Session
from omni_serve.graph.config import RealtimeConfig
from omni_serve.types import StageOutput, ToolCallDelta, Usage
from tests.realtime_session import (
    CREATE,
    decoded,
    replying,
    settle,
)
from tests.realtime_session import graph as graph
from tests.realtime_session import recorder as recorder


def statuses(events: list[dict[str, Any]]) -> list[str]:
    return [e["response"]["status"] for e in events if e["type"] == "response.done"]


def test_a_response_cancelled_before_its_relay_ran_still_ends_and_frees_the_session() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        await session.handle(CREATE)  # the relay task exists but has not run yet
        await session.responses.cancel("turn_detected")  # as a barge-in in the same audio append does
        await session.handle(CREATE)
        await settle(session)
        return events

    events = asyncio.run(run())
    assert not [e for e in events if e["type"] == "error"], events
    assert statuses(events) == ["cancelled", "completed"]


def test_a_cancel_while_the_response_finishes_does_not_cut_off_response_done() -> None:
    async def run() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        cancels: list[asyncio.Task[None]] = []

        def send(sent: dict[str, Any] | str) -> None:
            events.append(event := decoded(sent))
            if event["type"] == "response.output_text.done":  # the response is sending its closing events
                cancels.append(asyncio.ensure_future(session.responses.cancel("client_cancelled")))

        session = Session(graph(replying), send)
        await session.handle(CREATE)
        await settle(session)
        await asyncio.gather(*cancels)
        return events

    events = asyncio.run(run())
    assert statuses(events) == ["completed"]
    assert events[-1]["type"] == "response.done"


def test_a_failing_graph_ends_the_response_as_failed_and_the_session_goes_on() -> None:
    calls = 0

    async def failing_once(request: Any, route: str) -> AsyncIterator[StageOutput]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a stage died")
        async for output in replying(request, route):
            yield output

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(failing_once), send)
        for _ in range(2):
            await session.handle(CREATE)
            await settle(session)
        return events

    events = asyncio.run(run())
    assert statuses(events) == ["failed", "completed"]
    failed = next(e for e in events if e["type"] == "response.done")
    assert failed["response"]["status_details"]["error"]["type"] == "server_error"


def test_bounds_the_chat_route_has_hold_in_session_update() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        for config in (
            {"max_output_tokens": -5},
            {"audio": {"input": {"transcription": {"prompt": "x" * 5000}}}},
            {"audio": {"input": {"transcription": {"language": "not a language"}}}},
        ):
            await session.handle(json.dumps({"type": "session.update", "session": {"type": "realtime", **config}}))
        await session.handle(CREATE)  # the session still answers, with its defaults
        await settle(session)
        return events

    events = asyncio.run(run())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["type"] for e in errors] == ["invalid_request_error"] * 3, errors
    assert [e["param"] for e in errors] == [
        "session.max_output_tokens",
        "session.audio.input.transcription.prompt",
        "session.audio.input.transcription.language",
    ], errors
    assert statuses(events) == ["completed"]


def test_a_graph_without_audio_input_refuses_input_audio_and_says_it_detects_no_turns() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        session.send("session.created", session=session.session_json())
        await session.handle(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAAAA=="}))
        await session.handle(json.dumps({"type": "input_audio_buffer.commit"}))
        await session.handle(CREATE)  # the conversation still answers
        await settle(session)
        return events

    events = asyncio.run(run())
    assert events[0]["session"]["audio"]["input"]["turn_detection"] is None
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert errors[0]["param"] == "audio" and "takes no audio" in errors[0]["message"], errors
    assert not [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert statuses(events) == ["completed"]


# ---- function calling: what the session makes of the entry stage's calls (the parsing is the stage's) ----------

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def update(**session: Any) -> str:
    return json.dumps({"type": "session.update", "session": {"type": "realtime", **session}})


def test_tools_are_checked_as_chat_checks_them_and_errors_name_the_realtime_field() -> None:
    async def run() -> tuple[list[dict[str, Any]], Session]:
        events, send = recorder()
        session = Session(graph(replying), send)
        for bad in (
            update(tools=[{"type": "mcp", "server_label": "x"}]),
            update(tools=[TOOL], tool_choice={"type": "function", "name": "nope"}),
            update(tools=[TOOL, TOOL]),
            update(tool_choice="required"),  # no tools to choose from
            update(tools=[{**TOOL, "name": "has space"}]),
            json.dumps({"type": "response.create", "response": {"tool_choice": "required"}}),
            json.dumps({"type": "conversation.item.create", "item": {"type": "function_call", "name": "get_weather"}}),
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": "c", "output": ""},
                }
            ),  # answers no call
        ):
            await session.handle(bad)
        await session.handle(update(tool_choice="auto"))  # auto with no tools: the default, accepted
        return events, session

    events, session = asyncio.run(run())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["param"] for e in errors] == [
        "session.tools.0",
        "session.tool_choice.name",
        "session.tools",
        "session.tool_choice",
        "session.tools.0.name",
        "response.tool_choice",
        "item",
        "item.call_id",
    ], errors
    assert "nope" in errors[1]["message"] and "session.tool_choice.name" in errors[1]["message"]
    assert "mcp" in errors[0]["message"] and "call_id" in errors[6]["message"]
    assert session.settings.tools == [] and session.settings.tool_choice == "auto"
    assert not [e for e in events if e["type"] == "response.created"]


def call_pieces(*texts: str) -> list[ToolCallDelta]:
    return [ToolCallDelta(0, "call_1", "get_weather", texts[0]), *(ToolCallDelta(0, arguments=t) for t in texts[1:])]


def test_a_response_that_only_calls_a_tool_has_one_function_call_item_and_the_request_carries_the_tools() -> None:
    requests: list[Any] = []

    async def calling(request: Any, route: str) -> AsyncIterator[StageOutput]:
        requests.append(request)
        yield StageOutput(stage="thinker", tool_calls=call_pieces('{"unit"', ': "c"}'))
        yield StageOutput(stage="thinker", finished=True, usage=Usage(prompt_tokens=3, completion_tokens=9))

    async def run() -> tuple[list[dict[str, Any]], Session]:
        events, send = recorder()
        session = Session(graph(calling), send)
        await session.handle(update(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}))
        await session.handle(CREATE)
        await settle(session)
        return events, session

    events, session = asyncio.run(run())
    (request,) = requests
    assert request.tools.tools == [{"type": "function", "function": {"name": "get_weather", "description": None,
                                    "parameters": TOOL["parameters"]}}]  # fmt: skip
    assert request.tools.function == "get_weather"
    kinds = [e["type"] for e in events if e["type"].startswith("response.")]
    assert kinds == [
        "response.created",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.done",
    ], kinds
    (item,) = events[-1]["response"]["output"]
    assert item == {"id": item["id"], "type": "function_call", "object": "realtime.item", "status": "completed",
                    "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "c"}'}  # fmt: skip
    assert [i.type for i in session.conversation.items] == ["function_call"]


def test_a_call_cut_off_by_a_cancel_is_incomplete_and_is_no_call_in_the_next_prompt() -> None:
    requests: list[Any] = []

    async def calling_forever(request: Any, route: str) -> AsyncIterator[StageOutput]:
        requests.append(request)
        if len(requests) == 1:
            yield StageOutput(stage="thinker", text="Sure. ")
            yield StageOutput(stage="thinker", tool_calls=call_pieces('{"unit"'))
            await asyncio.Event().wait()  # the thinker still writing the call
        async for output in replying(request, route):
            yield output

    async def run() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []

        def send(sent: dict[str, Any] | str) -> None:
            events.append(event := decoded(sent))
            if event["type"] == "response.function_call_arguments.delta":
                asyncio.ensure_future(session.handle(json.dumps({"type": "response.cancel"})))

        session = Session(graph(calling_forever), send)
        await session.handle(update(tools=[TOOL]))
        await session.handle(CREATE)
        await settle(session)
        await session.handle(CREATE)
        await settle(session)
        return events

    events = asyncio.run(run())
    assert statuses(events) == ["cancelled", "completed"]
    cancelled = next(e for e in events if e["type"] == "response.done")["response"]
    message, call = cancelled["output"]
    assert (message["status"], message["content"][0]["text"]) == ("incomplete", "Sure. ")
    assert (call["status"], call["arguments"]) == ("incomplete", '{"unit"')
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"unit"' and done["output_index"] == 1
    (turn,) = requests[1].messages  # the reply's text, without the call it never finished
    assert (turn.role, turn.content, turn.tool_calls) == ("assistant", "Sure. ", None)


def test_calls_and_their_outputs_are_the_history_chat_makes_of_them() -> None:
    """Client-sent items: a reply's text and its two calls are one assistant turn with ``tool_calls`` (arguments as
    a JSON object when they parse, as chat hands them to the template), each output a ``tool`` turn."""
    requests: list[Any] = []

    async def recording(request: Any, route: str) -> AsyncIterator[StageOutput]:
        requests.append(request)
        async for output in replying(request, route):
            yield output

    def create(item: dict[str, Any]) -> str:
        return json.dumps({"type": "conversation.item.create", "item": item})

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(recording), send)
        await session.handle(
            create({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
        )
        await session.handle(
            create(
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]}
            )
        )
        for call_id, arguments in (("a", '{"unit": "c"}'), ("b", "not json")):
            await session.handle(create({"type": "function_call", "call_id": call_id, "name": "get_weather",
                                         "arguments": arguments}))  # fmt: skip
        for call_id in ("a", "b"):
            await session.handle(
                create({"type": "function_call_output", "call_id": call_id, "output": f"out {call_id}"})
            )
        await session.handle(CREATE)
        await settle(session)
        return events

    events = asyncio.run(run())
    assert not [e for e in events if e["type"] == "error"], events
    user, assistant, tool_a, tool_b = requests[0].messages
    assert (user.role, assistant.role, assistant.content) == ("user", "assistant", "Let me see.")
    assert assistant.tool_calls == [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
    ]
    assert [(t.role, t.content, t.tool_call_id) for t in (tool_a, tool_b)] == [
        ("tool", "out a", "a"),
        ("tool", "out b", "b"),
    ]


def test_openai_fields_that_would_change_the_reply_are_refused_by_name_and_the_rest_accepted() -> None:
    """Every GA field omni_serve cannot honour is an error naming it (never ignored); tracing and truncation,
    which change nothing a client gets back here, are accepted; each refused update leaves the session as it was."""
    refused = [
        ("session", {"include": ["item.input_audio_transcription.logprobs"]}, "session.include"),
        ("session", {"prompt": {"id": "pmpt_1"}}, "session.prompt"),
        ("session", {"reasoning": {"effort": "low"}}, "session.reasoning"),
        (
            "session",
            {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}},
            "session.audio.input.noise_reduction",
        ),
        ("session", {"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
        ("response", {"input": [{"type": "message", "role": "user", "content": []}]}, "response.input"),
        ("response", {"reasoning": {"effort": "low"}}, "response.reasoning"),
        ("response", {"audio": {"output": {"speed": 0.5}}}, "response.audio.output.speed"),
    ]
    accepted = {"tracing": "auto", "truncation": "auto", "include": [], "audio": {"output": {"speed": 1.0}}}

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        for where, fields, _ in refused:
            if where == "session":
                await session.handle(json.dumps({"type": "session.update", "session": {"type": "realtime", **fields}}))
            else:
                await session.handle(json.dumps({"type": "response.create", "response": fields}))
        await session.handle(json.dumps({"type": "session.update", "session": {"type": "realtime", **accepted}}))
        await session.handle(CREATE)
        await settle(session)
        return events

    events = asyncio.run(run())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["param"] for e in errors] == [param for _, _, param in refused], errors
    assert all(e["type"] == "invalid_request_error" for e in errors)
    assert [e["type"] for e in events if e["type"] == "session.updated"] == ["session.updated"]
    assert statuses(events) == ["completed"]  # no refused response.create started a response


# ---- any JSON at all: an error event, and the session goes on -------------------------------------------------

ODD = [[], [1], {}, {"a": 1}, 0, -1.5, None, True, "x", "x" * 600]
TEMPLATES: list[dict[str, Any]] = [
    {"type": "session.update", "event_id": "e", "session": {
        "type": "realtime", "instructions": "Hi.", "output_modalities": ["text"], "max_output_tokens": 5,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": True,
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None,
                            "transcription": {"language": "en", "prompt": "p"}},
                  "output": {"voice": "v", "speed": 1.0}}}},
    {"type": "conversation.item.create", "previous_item_id": None, "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}},
    {"type": "conversation.item.truncate", "item_id": "i", "content_index": 0, "audio_end_ms": 0},
    {"type": "conversation.item.delete", "item_id": "i"},
    {"type": "conversation.item.retrieve", "item_id": "i"},
    {"type": "response.create", "response": {
        "output_modalities": ["text"], "conversation": "none", "metadata": {"k": "v"}, "seed": 1,
        "stage_sampling": {"thinker": {"temperature": 0.5}}, "tools": [TOOL], "tool_choice": "auto"}},
    {"type": "response.cancel", "response_id": "r"},
    {"type": "input_audio_buffer.append", "audio": "AAAA"},
    {"type": "input_audio_buffer.commit"},
]  # fmt: skip


def paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value: the value itself, each key of an object, each element of an array."""
    inner: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        inner = [p for k, v in value.items() for p in paths(v, (*at, k))]
    elif isinstance(value, list):
        inner = [p for j, v in enumerate(value) for p in paths(v, (*at, j))]
    return [at, *inner]


def replaced(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[at[0]] = replaced(value[at[0]], at[1:], new)
    return copy


def test_any_json_value_in_any_place_of_an_event_gets_an_error_event_or_an_answer_and_the_session_goes_on() -> None:
    """Each client event's every field (the event itself, its ``type``, ``session``, ``item`` and what they hold)
    replaced in turn by values of every JSON type: no event kills the session (an exception out of ``handle``
    closes the socket with 1011), a refused one is an ``error`` event, and the session still answers."""
    limits = RealtimeConfig(events_per_second=1e9)
    events_sent = [json.dumps(replaced(t, at, odd)) for t in TEMPLATES for at in paths(t) for odd in ODD]
    events_sent += ["[]", "[1]", "1", '"x"', "null", "true", '{"type": {"type": "session.update"}}']

    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying, limits), send)
        for raw in events_sent:
            await session.handle(raw)
            await settle(session)
        await session.handle(json.dumps({"type": "response.cancel"}))
        events.clear()
        await session.handle(CREATE)
        await settle(session)
        return events

    events = asyncio.run(run())
    assert len(events_sent) > 700
    assert not [e for e in events if e["type"] == "error"], events
    assert statuses(events) == ["completed"]


def test_an_event_whose_type_is_no_string_is_an_unknown_event() -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying), send)
        for kind in ([], 1, None, {}, ["session.update"]):
            await session.handle(json.dumps({"type": kind, "event_id": "e"}))
        await session.handle(json.dumps({"type": "session.update", "session": []}))
        await session.handle(json.dumps(["session.update"]))
        return events

    events = asyncio.run(run())
    errors = [e["error"] for e in events]
    assert [e["code"] for e in errors[:5]] == ["unknown_event"] * 5, errors
    assert [e["param"] for e in errors[:6]] == ["type"] * 5 + ["session"], errors
    assert all(e["event_id"] == "e" for e in errors[:5]) and len(errors) == 7, errors
