"""Tool calling, structured outputs, logprobs and multi-turn audio on the tiny omni graph (transformers family),
end to end: `serve run graphs/tiny_omni.yaml`, real HTTP, the official ``openai`` client.

The tiny thinker has random weights, so what it says is forced where a test needs it: ``tool_choice``
``required`` or a named function (vLLM's structural tag for the hermes parser, enforced by xgrammar), a
``response_format``, or vLLM's ``structured_outputs`` regex for a reply of text then a call. Left free,
JSON's whitespace would run on (the random thinker's tab logit is 0, above most), so those requests bias
whitespace away with ``logit_bias``, as a client may.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Literal

import numpy as np
import openai
import pydantic
import pytest
import soundfile as sf

from tests.weather_tool import CALL, NO_WHITESPACE, SURE, WEATHER, literal

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-omni"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
AUDIO = {"voice": "ethan", "format": "wav"}
SHORT_TALK = {"talker": {"max_tokens": 12}}


@pytest.fixture(scope="module")
def client(tiny_omni) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_omni.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def samples(b64: str) -> np.ndarray:
    data, _ = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32", always_2d=True)
    return data[:, 0]


class Weather(pydantic.BaseModel):
    unit: Literal["c", "f"]  # a free string would run on: the random thinker has no reason to close it
    raining: bool


def test_parse_with_a_pydantic_model_gets_an_instance_of_it(client: openai.OpenAI) -> None:
    """``chat.completions.parse``: the client sends the model's JSON schema as response_format (json_schema,
    strict) and parses the reply into the model; the thinker's output is held to the schema."""
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Weather, temperature=0, max_tokens=120, logit_bias=NO_WHITESPACE
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # the grammar ended it: the JSON is complete
    assert isinstance(choice.message.parsed, Weather)
    assert json.loads(choice.message.content or "") == choice.message.parsed.model_dump()


def test_a_streamed_tool_call_comes_in_pieces_and_finishes_with_tool_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
        logit_bias=NO_WHITESPACE,
        stream=True,
    )
    chunks = list(stream)
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(pieces) > 1 and pieces[0].id and pieces[0].function.name == "get_weather"
    assert {p.index for p in pieces} == {0} and all(p.id is None for p in pieces[1:])
    arguments = json.loads("".join(p.function.arguments or "" for p in pieces))
    assert arguments["unit"] in ("c", "f")
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # the call is no text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_tool_call_round_trip_with_the_tools_result(client: openai.OpenAI) -> None:
    """A named call, its result sent back as a tool message, and the next reply, whose prompt holds both."""
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=120,
        logit_bias=NO_WHITESPACE,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "stop"  # OpenAI: a named choice finishes with stop
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in ("c", "f")
    history = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=6, seed=3, extra_body={"return_prompt_text": True}
    )
    prompt = second.model_extra["prompt_text"]  # type: ignore[index]
    assert (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(json.loads(call.function.arguments))}}}'
        in (prompt)
    )  # the assistant's call, in the model's syntax
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in prompt
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_a_reply_with_text_and_a_call_speaks_only_the_text(client: openai.OpenAI) -> None:
    """The audio of "Sure. <call>" is the audio of "Sure. " alone, sample for sample (same seed): the talker
    never got the call's rows. A reply that only calls a tool says nothing, streamed or not."""
    common: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [WEATHER],
        "modalities": ["text", "audio"],
        "audio": AUDIO,
        "temperature": 0,
        "max_tokens": 120,
        "seed": 11,
    }
    both = client.chat.completions.create(**common, extra_body={**literal(SURE + CALL), "stage_sampling": SHORT_TALK})
    text = client.chat.completions.create(**common, extra_body={**literal(SURE), "stage_sampling": SHORT_TALK})
    assert both.choices[0].message.content == text.choices[0].message.content == SURE
    # The talker stops at SHORT_TALK's 12 frames, so both replies say "length" (any stage cut short wins:
    # docs/api.md, "Cut short"); the call is in message.tool_calls. A call alone, unspoken, says "tool_calls".
    assert both.choices[0].finish_reason == text.choices[0].finish_reason == "length"
    (call,) = both.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"unit": "c"})
    assert both.choices[0].message.audio.transcript == SURE  # type: ignore[union-attr]
    spoken, alone = samples(both.choices[0].message.audio.data), samples(text.choices[0].message.audio.data)  # type: ignore[union-attr]
    assert spoken.size > 0 and np.abs(spoken).max() > 0
    np.testing.assert_array_equal(spoken, alone)
    forced = {**common, "tool_choice": "required", "parallel_tool_calls": False, "logit_bias": NO_WHITESPACE}
    silent = client.chat.completions.create(**forced)
    assert silent.choices[0].message.tool_calls and silent.choices[0].message.audio is None
    assert silent.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**forced, stream=True))
    assert not [c for c in chunks if c.choices and c.choices[0].delta.model_extra.get("audio")]
    assert [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]


def test_logprobs_streamed_and_not_are_the_same(client: openai.OpenAI) -> None:
    common: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 8, "seed": 5, "logprobs": True}
    whole = client.chat.completions.create(**common, top_logprobs=2).choices[0]
    content = whole.logprobs.content  # type: ignore[union-attr]
    assert len(content) == 8 and "".join(t.token for t in content) == whole.message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    streamed = [
        t
        for c in client.chat.completions.create(**common, top_logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    bare = client.chat.completions.create(**common).choices[0].logprobs.content  # type: ignore[union-attr]
    assert [t.top_logprobs for t in bare] == [[]] * 8


def test_an_earlier_audio_reply_named_by_its_id_is_its_transcript(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        modalities=["text", "audio"],
        audio=AUDIO,
        max_tokens=6,
        seed=2,
        extra_body={"stage_sampling": SHORT_TALK},
    )
    audio = first.choices[0].message.audio
    assert audio is not None and audio.transcript
    history = [*ASK, {"role": "assistant", "audio": {"id": audio.id}}, {"role": "user", "content": "And tomorrow?"}]
    second = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=2, extra_body={"return_prompt_text": True}
    )
    assert f"<|im_start|>assistant\n{audio.transcript}<|im_end|>" in second.model_extra["prompt_text"]  # type: ignore[index]
    unknown = [*ASK, {"role": "assistant", "audio": {"id": "audio-never-made"}}]
    with pytest.raises(openai.BadRequestError, match="no audio reply 'audio-never-made' is known here") as refused:
        client.chat.completions.create(model=MODEL, messages=unknown, max_tokens=2)
    assert refused.value.body["param"] == "messages.1.audio.id"  # type: ignore[index]
