"""Malformed and hostile requests against the tiny graph: each gets a 4xx OpenAI error naming the problem.

One deployment for the module; the server must stay healthy and keep answering normal requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3-omni"
OK_MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    """A valid small request with ``fields`` changed (a value of ``...`` removes the field)."""
    body: dict[str, Any] = {"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 4}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not ...}


def msg(content: Any, role: str = "user", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content, **extra}]}


def tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "lookup", **function}}


RESERVED_SCHEMA = {"type": "object", "properties": {"q": {"type": "string", "description": "<|image_pad|>"}}}
JSON = {"content-type": "application/json"}

# (id, request kwargs for httpx, expected status, text that must appear in message or param)
CORPUS: list[tuple[str, dict[str, Any], int, str]] = [
    # --- the body as bytes ---
    ("empty body", {"content": b"", "headers": JSON}, 400, "empty"),
    ("not json", {"content": b"hello", "headers": JSON}, 400, "not valid JSON"),
    ("truncated json", {"content": b'{"messages": [', "headers": JSON}, 400, "not valid JSON"),
    ("trailing garbage", {"content": b'{"messages": []} xx', "headers": JSON}, 400, "not valid JSON"),
    ("json array", {"content": b"[1, 2]", "headers": JSON}, 400, "JSON object"),
    ("json string", {"content": b'"hi"', "headers": JSON}, 400, "JSON object"),
    ("json null", {"content": b"null", "headers": JSON}, 400, "JSON object"),
    ("non-utf8 body", {"content": b'{"messages": "\xff\xfe"}', "headers": JSON}, 400, "UTF-8"),
    ("latin-1 body", {"content": '{"model": "café"}'.encode("latin-1"), "headers": JSON}, 400, "UTF-8"),
    ("utf-8 bom", {"content": b"\xef\xbb\xbf" + json.dumps(chat()).encode(), "headers": JSON}, 400, "not valid JSON"),
    ("NaN literal", {"content": b'{"messages": [], "temperature": NaN}', "headers": JSON}, 400, "NaN"),
    ("nested 100k deep", {"content": b"[" * 100_000 + b"]" * 100_000, "headers": JSON}, 400, "not valid JSON"),
    ("huge int literal", {"content": b'{"max_tokens": 1' + b"0" * 5000 + b"}", "headers": JSON}, 400, "JSON"),
    # The tiny graph takes 8 MiB bodies (media arrive base64-encoded in them).
    ("oversized body", {"content": json.dumps(msg("x" * (9 << 20))).encode(), "headers": JSON}, 413, "bytes"),
    ("oversized chunked body", {"content": iter([b'{"a": "' + b"x" * (1 << 16)] * 160), "headers": JSON}, 413, "bytes"),
    (
        "wrong content-type text",
        {"content": json.dumps(chat()).encode(), "headers": {"content-type": "text/plain"}},
        415,
        "application/json",
    ),
    (
        "form content-type",
        {"content": b"messages=hi", "headers": {"content-type": "application/x-www-form-urlencoded"}},
        415,
        "application/json",
    ),
    ("multipart", {"files": {"file": ("a.json", b"{}")}}, 415, "application/json"),
    # --- the top level ---
    ("missing messages", {"json": chat(messages=...)}, 400, "messages"),
    ("empty messages", {"json": chat(messages=[])}, 400, "messages"),
    ("messages not a list", {"json": chat(messages={"role": "user"})}, 400, "messages"),
    ("tool without its function", {"json": chat(tools=[{"type": "function"}])}, 400, "tools.0.function"),
    # A tool's text reaches the template as a message's does: a reserved multimodal token in it is a 400 (not a 500).
    (
        "tool description with a reserved token",
        {"json": chat(tools=[tool(description="x <|audio_pad|> y")])},
        400,
        "tools.0",
    ),
    ("tool schema with a reserved token", {"json": chat(tools=[tool(parameters=RESERVED_SCHEMA)])}, 400, "tools.0"),
    ("response_format of no known type", {"json": chat(response_format={"type": "xml"})}, 400, "response_format"),
    ("unknown model", {"json": chat(model="gpt-5")}, 404, "model"),
    (
        "model lone surrogate",
        {"content": b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "headers": JSON},
        404,
        "model",
    ),
    ("model not a string", {"json": chat(model=["x"])}, 400, "model"),
    ("n=2", {"json": chat(n=2)}, 400, "one choice per request"),
    ("stream not bool", {"json": chat(stream="maybe")}, 400, "stream"),
    ("stream_options unknown key", {"json": chat(stream=True, stream_options={"x": 1})}, 400, "stream_options"),
    # OpenAI's fields that would change the reply and cannot be honoured: each refused by name, saying why
    ("functions (deprecated)", {"json": chat(functions=[{"name": "f"}])}, 400, "send tools"),
    ("function_call (deprecated)", {"json": chat(function_call="auto")}, 400, "send tool_choice"),
    ("reasoning_effort", {"json": chat(reasoning_effort="low")}, 400, "no reasoning effort"),
    ("verbosity", {"json": chat(verbosity="low")}, 400, "no verbosity control"),
    ("web_search_options", {"json": chat(web_search_options={})}, 400, "no web search"),
    ("moderation", {"json": chat(moderation={"model": "omni-moderation-latest"})}, 400, "no moderation"),
    ("store true", {"json": chat(store=True)}, 400, "keeps no completions"),
    ("metadata over 16 pairs", {"json": chat(metadata={str(i): "v" for i in range(17)})}, 400, "metadata"),
    ("top_logprobs without logprobs", {"json": chat(top_logprobs=3)}, 400, "top_logprobs"),
    ("top_logprobs over 20", {"json": chat(logprobs=True, top_logprobs=50)}, 400, "top_logprobs"),
    (
        "json_schema without schema",
        {"json": chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})},
        400,
        "json_schema.schema",
    ),
    (
        "response_format and structured_outputs",
        {"json": chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"})},
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs of two kinds",
        {"json": chat(structured_outputs={"regex": "a", "json_object": True})},
        400,
        "exactly one kind",
    ),
    ("regex that does not compile", {"json": chat(structured_outputs={"regex": "(open"})}, 400, "does not compile"),
    ("custom tool", {"json": chat(tools=[{"type": "custom", "custom": {"name": "x"}}])}, 400, "custom tools"),
    ("tool_choice without tools", {"json": chat(tool_choice="required")}, 400, "tool_choice"),
    (
        "tool_choice naming no tool",
        {
            "json": chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            )
        },
        400,
        "tool_choice.function.name",
    ),
    (
        "tool result answering no call",
        {"json": chat(messages=[*OK_MESSAGES, {"role": "tool", "tool_call_id": "c1", "content": "42"}])},
        400,
        "messages.1.tool_call_id",
    ),
    ("tool message without its call id", {"json": chat(**msg("42", role="tool"))}, 400, "tool_call_id"),
    (
        "assistant audio id never made",
        {"json": chat(messages=[*OK_MESSAGES, {"role": "assistant", "audio": {"id": "audio-x"}}])},
        400,
        "messages.1.audio.id",
    ),
    ("logit_bias outside the vocabulary", {"json": chat(logit_bias={"99999999": 5})}, 400, "logit_bias"),
    # vLLM's extra sampling parameters the transformers thinker cannot honour: refused by name
    ("frequency_penalty set", {"json": chat(frequency_penalty=0.5)}, 400, "frequency_penalty"),
    ("min_tokens on the thinker", {"json": chat(min_tokens=2)}, 400, "min_tokens"),
    ("min_p out of range", {"json": chat(min_p=2)}, 400, "min_p"),
    ("use_beam_search", {"json": chat(use_beam_search=True)}, 400, "use_beam_search"),
    (
        "min_p on the talker",
        {"json": chat(stage_sampling={"talker": {"min_p": 0.1}})},
        400,
        "stage_sampling.talker.min_p",
    ),
    # --- sampling ---
    ("negative max_tokens", {"json": chat(max_tokens=-1)}, 400, "max_tokens"),
    ("zero max_tokens", {"json": chat(max_tokens=0)}, 400, "max_tokens"),
    ("huge max_tokens", {"json": chat(max_tokens=10**30)}, 400, "max_tokens"),
    ("max_tokens string", {"json": chat(max_tokens="many")}, 400, "max_tokens"),
    ("max_completion_tokens float", {"json": chat(max_completion_tokens=3.5)}, 400, "max_completion_tokens"),
    ("temperature too high", {"json": chat(temperature=5)}, 400, "temperature"),
    ("temperature string", {"json": chat(temperature="hot")}, 400, "temperature"),
    ("top_p zero", {"json": chat(top_p=0)}, 400, "top_p"),
    ("top_k negative", {"json": chat(top_k=-3)}, 400, "top_k"),
    ("seed negative", {"json": chat(seed=-1)}, 400, "seed"),
    ("seed over 64 bits", {"json": chat(seed=2**64)}, 400, "seed"),
    ("five stop strings", {"json": chat(stop=["a", "b", "c", "d", "e"])}, 400, "stop"),
    ("empty stop string", {"json": chat(stop="")}, 400, "stop"),
    ("repetition_penalty zero", {"json": chat(repetition_penalty=0)}, 400, "repetition_penalty"),
    # --- strict types, as OpenAI's: no coercion of strings or numbers into booleans, of booleans into numbers ---
    ("logprobs a string", {"json": chat(logprobs="yes")}, 400, "logprobs"),
    ("logprobs a number", {"json": chat(logprobs=1)}, 400, "logprobs"),
    ("temperature a boolean", {"json": chat(temperature=True)}, 400, "temperature"),
    ("max_tokens numeric string", {"json": chat(max_tokens="4")}, 400, "max_tokens"),
    ("seed a float", {"json": chat(seed=3.0)}, 400, "seed"),
    (
        "stream_options flag a string",
        {"json": chat(stream=True, stream_options={"include_usage": "true"})},
        400,
        "include_usage",
    ),
    # --- messages ---
    ("message without role", {"json": chat(messages=[{"content": "hi"}])}, 400, "role"),
    ("unknown role", {"json": chat(**msg("hi", role="function"))}, 400, "role"),
    ("content null", {"json": chat(**msg(None))}, 400, "content"),
    ("content empty list", {"json": chat(**msg([]))}, 400, "content"),
    ("content number", {"json": chat(**msg(123))}, 400, "content"),
    ("content dict", {"json": chat(**msg({"text": "hi"}))}, 400, "content"),
    ("part without type", {"json": chat(**msg([{"text": "hi"}]))}, 400, "type"),
    ("unknown part type", {"json": chat(**msg([{"type": "hologram", "data": "x"}]))}, 400, "hologram"),
    ("text part without text", {"json": chat(**msg([{"type": "text"}]))}, 400, "text"),
    ("text part extra key", {"json": chat(**msg([{"type": "text", "text": "hi", "x": 1}]))}, 400, "x"),
    ("message extra key", {"json": chat(**msg("hi", refusal="no"))}, 400, "refusal"),
    ("tool calls on a user message", {"json": chat(**msg("hi", tool_calls=[]))}, 400, "tool_calls"),
    (
        "lone surrogate",
        {"content": b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "headers": JSON},
        400,
        "surrogate",
    ),
    ("nested garbage in content", {"json": chat(**msg([[[[{"type": "text"}]]]]))}, 400, "content"),
    ("prompt longer than context", {"json": chat(**msg("word " * 20_000))}, 400, "context"),
    # --- modalities and audio ---
    ("unknown modality", {"json": chat(modalities=["video"])}, 400, "modalities"),
    ("image modality on audio graph", {"json": chat(modalities=["text", "image"])}, 400, "image"),
    ("empty modalities", {"json": chat(modalities=[])}, 400, "modalities"),
    ("modalities a string", {"json": chat(modalities="audio")}, 400, "modalities"),
    ("audio format ogg", {"json": chat(modalities=["text", "audio"], audio={"format": "ogg"})}, 400, "audio.format"),
    ("audio not an object", {"json": chat(modalities=["text", "audio"], audio="wav")}, 400, "audio"),
    ("unknown voice", {"json": chat(modalities=["text", "audio"], audio={"voice": "nobody"})}, 400, "nobody"),
    ("unknown speaker", {"json": chat(modalities=["text", "audio"], speaker="nobody")}, 400, "speaker"),
    ("unknown speaker, text reply", {"json": chat(speaker="nobody")}, 400, "speaker"),  # refused, never ignored
    ("unknown voice, text reply", {"json": chat(audio={"voice": "nobody"})}, 400, "audio.voice"),
    ("voice and speaker differ", {"json": chat(modalities=["audio"], voice="ethan", speaker="chelsie")}, 400, "voices"),
    # --- stage_sampling ---
    ("stage_sampling unknown stage", {"json": chat(stage_sampling={"vocoder": {}})}, 400, "vocoder"),
    ("stage_sampling unknown key", {"json": chat(stage_sampling={"talker": {"beam": 4}})}, 400, "stage_sampling"),
    ("stage_sampling bad value", {"json": chat(stage_sampling={"talker": {"max_tokens": -5}})}, 400, "max_tokens"),
    (
        "stage_sampling huge max_tokens",
        {"json": chat(stage_sampling={"talker": {"max_tokens": 10**12}})},
        400,
        "max_tokens",
    ),
    ("stage_sampling not a dict", {"json": chat(stage_sampling=["talker"])}, 400, "stage_sampling"),
    ("stage_sampling stage not a dict", {"json": chat(stage_sampling={"talker": 0.9})}, 400, "stage_sampling"),
    ("stage_sampling wrong type", {"json": chat(stage_sampling={"thinker": {"stop": 7}})}, 400, "stop"),
    # --- vLLM-Omni's sampling_params_list ---
    ("sampling_params_list not a list", {"json": chat(sampling_params_list={"temperature": 1})}, 400, "list"),
    ("sampling_params_list entry not a dict", {"json": chat(sampling_params_list=[0.4])}, 400, "sampling_params"),
    ("sampling_params_list too long", {"json": chat(sampling_params_list=[{}] * 9)}, 400, "3 stages"),
    (
        "sampling_params_list unknown field",
        {"json": chat(sampling_params_list=[{"use_beam_search": True}])},
        400,
        "sampling_params_list.0.use_beam_search",
    ),
    (
        "sampling_params_list field the talker cannot honour",
        {"json": chat(sampling_params_list=[{}, {"presence_penalty": 0.5}])},
        400,
        "sampling_params_list.1.presence_penalty",
    ),
    (
        "sampling_params_list huge max_tokens",
        {"json": chat(sampling_params_list=[{}, {"max_tokens": 10**12}])},
        400,
        "max_tokens",
    ),
    (
        "both per-stage forms",
        {"json": chat(sampling_params_list=[{}], stage_sampling={"talker": {}})},
        400,
        "sampling_params_list",
    ),
]


@pytest.fixture(scope="module")
def client(tiny_omni) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_omni.base_url, timeout=60) as client:
        yield client


def error_of(reply: httpx.Response) -> dict[str, Any]:
    body = reply.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(("request_kwargs", "status", "names"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_bad_request_gets_an_openai_error_naming_the_problem(
    client: httpx.Client, request_kwargs: dict[str, Any], status: int, names: str
) -> None:
    reply = client.post("/v1/chat/completions", **request_kwargs)
    assert reply.status_code == status, reply.text[:500]
    error = error_of(reply)
    assert names.lower() in f"{error['message']} {error['param']}".lower(), error


def test_unknown_route_and_wrong_method_are_openai_errors(client: httpx.Client) -> None:
    assert error_of(missing := client.post("/v1/completions", json={})) and missing.status_code == 404
    assert error_of(wrong := client.get("/v1/chat/completions")) and wrong.status_code == 405


def test_media_parts_are_refused_naming_the_exact_part(client: httpx.Client) -> None:
    """Media the default media policy or the decoder refuses; ``param`` points at the message and part
    (tests/test_omni_input.py has the hostile-media corpus under a policy that allows a local server)."""
    parts = [
        ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}, "media policy"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "not a valid png"),
        ({"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}, "file: URLs are not accepted"),
        ({"type": "video_url", "video_url": {"url": "https://127.0.0.1:9/clip.mp4"}}, "allow-list"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "no known format"),
        ({"type": "file", "file": {"file_id": "/etc/passwd"}}, "not supported"),
    ]
    for part, says in parts:
        messages = [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},  # a part list that is fine
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
        ]
        reply = client.post("/v1/chat/completions", json=chat(messages=messages))
        assert reply.status_code == 400, reply.text
        error = error_of(reply)
        assert says in error["message"], error
        assert error["param"] == "messages.1.content.1"


def test_a_stage_raised_400_names_its_field(client: httpx.Client) -> None:
    reply = client.post("/v1/chat/completions", json=chat(**msg("word " * 20_000)))
    assert reply.status_code == 400
    assert error_of(reply)["param"] == "messages" and "context" in error_of(reply)["message"]


def test_vllm_sampling_parameters_the_thinker_honours_are_accepted(client: httpx.Client) -> None:
    """What `vllm bench serve` sends (ignore_eos) and vLLM parameters the transformers thinker maps onto HF."""
    body = chat(max_tokens=6, ignore_eos=True, min_p=0.05, skip_special_tokens=True, top_k=-1, seed=3, stream=True)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 6  # ignore_eos: the whole budget


def test_server_is_healthy_and_serves_after_the_corpus(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    reply = client.post(
        "/v1/chat/completions",
        json=chat(modalities=["text", "audio"], seed=1, stage_sampling={"talker": {"max_tokens": 8}}),
    )
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] and message["audio"]["data"]
