"""OpenAI's chat request fields one by one (the installed ``openai`` package's ``completion_create_params`` is
the list), the reply's tool calls and logprobs, and earlier audio replies by id; in process, no graph.

The end-to-end behaviour (real engines, the official client) is in tests/test_chat_tools.py and
tests/test_vllm_engine.py; each refused field's 400 over HTTP is in tests/test_bad_input.py.
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, completion_create_params
from pydantic import ValidationError

from omni_serve.api.openai.audio_replies import AudioReplies
from omni_serve.api.openai.chat import REFUSED, ChatCompletionRequest, ChatReply
from omni_serve.api.openai.errors import APIError, from_validation
from omni_serve.api.openai.messages import MediaRules
from omni_serve.media.inputs import MediaInputConfig
from omni_serve.media.policy import MediaPolicy
from omni_serve.types import FinishReason, Modality, StageOutput, TokenLogprob, ToolCallDelta, Usage

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
RULES = MediaRules(frozenset({"text"}), MediaPolicy(), MediaInputConfig())


def parse(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HI, **fields})


def refusal(**fields: Any) -> APIError:
    """The 400 a request with ``fields`` gets, whether the model or the request's own checks refuse it."""
    try:
        request = parse(**fields)
        request.tool_calling()
        request.chat_messages(RULES, AudioReplies().transcript)
    except ValidationError as err:
        return from_validation(err)
    except APIError as err:
        return err
    raise AssertionError(f"{fields} was accepted")


# ---- every field of OpenAI's chat request ---------------------------------------------------------------

# Each field of openai's CompletionCreateParams and what omni_serve does with it (docs/api.md has the why).
HONOURED = {
    "messages", "model", "audio", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "modalities", "parallel_tool_calls", "presence_penalty", "response_format", "seed", "stop",
    "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "n", "store",
}  # fmt: skip
HARMLESS = {
    "user", "safety_identifier", "metadata", "service_tier", "prediction", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options",
}  # fmt: skip


def test_every_field_of_openais_chat_request_is_decided() -> None:
    """A field the installed openai package sends that omni_serve neither takes nor refuses by name fails here."""
    fields = set()
    for params in typing.get_args(completion_create_params.CompletionCreateParams):
        fields |= set(typing.get_type_hints(params))
    assert fields == HONOURED | HARMLESS | set(REFUSED)
    assert fields <= set(ChatCompletionRequest.model_fields)


def test_fields_that_change_nothing_are_accepted() -> None:
    request = parse(
        user="u-1",
        safety_identifier="hash",
        metadata={"session": "s1"},
        store=False,
        service_tier="flex",
        prediction={"type": "content", "content": "Hello"},
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        parallel_tool_calls=True,
        stream_options={"include_obfuscation": False},
        stream=True,
    )
    assert request.entry_sampling() == {}  # none of them reaches the engines


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_fields_that_cannot_be_honoured_are_refused_naming_them_and_why(field: str) -> None:
    error = refusal(**{field: "anything"})
    assert (error.status, error.param) == (400, field)
    assert REFUSED[field] in error.message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"n": 2}, "n", "one choice per request"),
        ({"store": True}, "store", "keeps no completions"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "512"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "send one of them",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one kind"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0", "custom tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "two functions"),
        ({"tools": [WEATHER] * 129}, "tools", "128"),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not one of the tools",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice", "allowed"),
        ({"messages": [{"role": "tool", "content": "20 C"}]}, "messages.0", "tool_call_id"),
        (
            {"messages": [*HI, {"role": "tool", "tool_call_id": "c9", "content": "20 C"}]},
            "messages.1.tool_call_id",
            "answers no tool call",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0", "tool messages only"),
        ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages.0", "assistant"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.0.role", "role"),
        (
            {"messages": [*HI, {"role": "assistant", "audio": {"id": "audio-1"}}]},
            "messages.1.audio.id",
            "no audio reply 'audio-1' is known here",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    error = refusal(**fields)
    assert error.status == 400
    assert error.param == param or (error.param or "").startswith(param), error.message
    assert says in error.message, error.message


def test_response_format_and_logprobs_become_the_entry_stages_sampling() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    sampling = parse(
        logprobs=True,
        top_logprobs=3,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    ).entry_sampling()
    assert sampling["logprobs"] == 3 and sampling["structured_outputs"].json_schema == schema
    assert parse(logprobs=True).entry_sampling()["logprobs"] == 0  # the sampled token's only
    assert parse(response_format={"type": "json_object"}).entry_sampling()["structured_outputs"].json_object
    assert "structured_outputs" not in parse(response_format={"type": "text"}).entry_sampling()
    assert parse(structured_outputs={"choice": ["a", "b"]}).entry_sampling()["structured_outputs"].choice == ["a", "b"]
    assert parse(response_format={"type": "json_object"}).client_field("structured_outputs") == "response_format"


def test_tools_choices_and_history_reach_the_entry_stage() -> None:
    request = parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calling = request.tool_calling()
    assert calling is not None and (calling.function, calling.choice, calling.parallel) == ("get_weather", "auto", True)
    # As vLLM hands tools to the chat template (so the prompt is vllm serve's): description and parameters always.
    assert calling.tools == [{"type": "function", "function": {**WEATHER["function"], "description": None}}]
    assert parse(tools=[WEATHER], parallel_tool_calls=False).tool_calling().parallel is False  # type: ignore[union-attr]
    assert parse(tools=[WEATHER], tool_choice="none").tool_calling().choice == "none"  # type: ignore[union-attr]
    assert parse().tool_calling() is None
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}
    history = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "20 C"}]},
    ]
    _, assistant, tool = parse(messages=history, tools=[WEATHER]).chat_messages(RULES)
    assert assistant.content == "" and assistant.tool_calls == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}}
    ]  # arguments as a JSON object for the template, as vLLM hands them over
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "20 C", "c1")


# ---- the reply: calls and logprobs --------------------------------------------------------------------


def reply(modalities: set[Modality], outputs: list[StageOutput], stream: bool, **options: Any) -> Any:
    built = ChatReply("r1", "tiny", modalities, "wav", "thinker", **options)

    async def items() -> AsyncIterator[StageOutput]:
        for output in outputs:
            yield output

    async def run() -> Any:
        if not stream:
            return await built.json(items())
        events = [e.removeprefix("data: ").strip() async for e in built.stream(items())]
        assert events[-1] == "[DONE]"
        return events[:-1]

    return asyncio.run(run())


def call_outputs(text: str = "") -> list[StageOutput]:
    """A thinker that said ``text``, then called get_weather (its arguments in three pieces), with logprobs."""

    def lp(token: str) -> TokenLogprob:
        return TokenLogprob(token, -0.5, [(token, -0.5), ("x", -1.5)])

    first = [ToolCallDelta(0, "call-1", "get_weather", '{"unit"')]
    return [
        StageOutput("thinker", text=text, token_ids=[1], usage=Usage(9, 1), logprobs=[lp("a")]),
        StageOutput("thinker", token_ids=[2], tool_calls=first, usage=Usage(9, 2), logprobs=[lp("b")]),
        StageOutput("thinker", token_ids=[3], usage=Usage(9, 3), logprobs=[lp("c")]),  # held back by the parser
        StageOutput(
            "thinker",
            token_ids=[4],
            tool_calls=[ToolCallDelta(0, None, None, ': "c"'), ToolCallDelta(0, None, None, "}")],
            usage=Usage(9, 4),
            logprobs=[lp("d")],
            finished=True,
            finish_reason=FinishReason.TOOL_CALLS,
        ),
    ]


def test_a_json_reply_carries_the_calls_whole_and_every_tokens_logprob() -> None:
    body = reply({Modality.TEXT}, call_outputs(), stream=False, logprobs=True)
    parsed = ChatCompletion.model_validate(body)  # the official client's model reads it
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None  # a call alone: no content
    (call,) = choice.message.tool_calls or []
    assert (call.id, call.type, call.function.name, call.function.arguments) == (
        "call-1",
        "function",
        "get_weather",
        '{"unit": "c"}',
    )
    assert [t.token for t in choice.logprobs.content] == ["a", "b", "c", "d"]  # type: ignore[union-attr]
    assert choice.logprobs.content[0].top_logprobs[1].token == "x"  # type: ignore[union-attr]
    assert choice.logprobs.content[0].bytes == [ord("a")]  # type: ignore[union-attr]
    assert reply({Modality.TEXT}, call_outputs("Sure."), stream=False)["choices"][0]["message"]["content"] == "Sure."
    assert reply({Modality.TEXT}, call_outputs(), stream=False)["choices"][0]["logprobs"] is None  # not asked


def test_a_stream_carries_the_calls_in_pieces_and_the_logprobs_with_the_chunks() -> None:
    events = reply({Modality.TEXT}, call_outputs("Sure."), stream=True, logprobs=True)
    parsed = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events]
    pieces = [tc for c in parsed for tc in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id == "call-1" and pieces[0].type == "function" and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == '{"unit": "c"}'
    assert parsed[-1].choices[0].finish_reason == "tool_calls"
    tokens = [t.token for c in parsed if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert tokens == ["a", "b", "c", "d"]  # every token once, the held-back one with the next chunk sent


def test_an_audio_reply_that_only_calls_a_tool_has_no_audio() -> None:
    message = reply({Modality.TEXT, Modality.AUDIO}, call_outputs(), stream=False)["choices"][0]["message"]
    assert message["audio"] is None and message["tool_calls"]


# ---- earlier audio replies by id --------------------------------------------------------------------


def test_an_audio_reply_is_remembered_by_its_id_until_it_expires() -> None:
    now = [1000.0]
    replies = AudioReplies(clock=lambda: now[0])
    speech = [
        StageOutput("thinker", text="Hello there", usage=Usage(9, 2), finished=True, finish_reason=FinishReason.STOP),
        StageOutput("code2wav", audio=np.zeros(240, dtype=np.float32), sample_rate=24000, finished=True),
    ]
    body = reply({Modality.TEXT, Modality.AUDIO}, speech, stream=False, remember=replies.remember)
    audio = body["choices"][0]["message"]["audio"]
    assert audio["id"] == "audio-r1" and audio["transcript"] == "Hello there"
    streamed = ChatReply("r2", "tiny", {Modality.AUDIO}, "wav", "thinker", remember=replies.remember)

    async def stream_it() -> None:
        async def items() -> AsyncIterator[StageOutput]:
            for output in speech:
                yield output

        [_ async for _ in streamed.stream(items())]

    asyncio.run(stream_it())
    assert replies.transcript("audio-r2", "p") == "Hello there"
    history = [*HI, {"role": "assistant", "audio": {"id": "audio-r1"}}, {"role": "user", "content": "Again?"}]
    turns = parse(messages=history).chat_messages(RULES, replies.transcript)
    assert (turns[1].role, turns[1].content) == ("assistant", "Hello there")
    # The reply's message sent back as it came (content, and audio with id, data, expires_at, transcript): its
    # content is the turn, whatever this replica keeps (an id it never made included).
    back = [*HI, {"role": "assistant", "content": "Hello there", "audio": audio}]
    assert parse(messages=back).chat_messages(RULES, AudioReplies().transcript)[1].content == "Hello there"
    assert (
        parse(messages=[*HI, {"role": "assistant", "audio": audio}]).chat_messages(RULES, replies.transcript)[1].content
        == "Hello there"
    )
    now[0] = audio["expires_at"]
    with pytest.raises(APIError, match="expired at") as expired:
        parse(messages=history).chat_messages(RULES, replies.transcript)
    assert expired.value.param == "messages.1.audio.id"


def test_the_store_is_bounded_in_count_and_bytes_oldest_first() -> None:
    replies = AudioReplies(max_replies=3, max_bytes=100, clock=lambda: 0.0)
    for i in range(4):
        replies.remember(f"a{i}", "x" * 10, 10)
    assert len(replies) == 3
    with pytest.raises(APIError, match="no audio reply 'a0'"):
        replies.transcript("a0", "p")
    replies.remember("big", "y" * 90, 10)  # 93 bytes: the others make room
    assert len(replies) == 1 and replies.bytes == 93 and replies.transcript("big", "p") == "y" * 90
    replies.remember("huge", "z" * 200, 10)  # over the whole store: not kept, nothing evicted for it
    assert len(replies) == 1
