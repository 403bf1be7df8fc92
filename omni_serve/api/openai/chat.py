"""`POST /v1/chat/completions`: the request model, and the response and stream chunks built from stage outputs.

Audio in a stream: every audio chunk is its own SSE chunk with ``modality: "audio"``
(vLLM-Omni's tag) and ``delta.audio = {id, data}`` (OpenAI's field), where ``data`` is a
self-contained file in the requested format (a whole WAV/MP3/... per chunk, or raw 16-bit
PCM for ``pcm16``, which is what OpenAI's own streaming audio sends). When text was not
asked for, the text stage's deltas travel as ``delta.audio.transcript``, as OpenAI does.

Usage in a stream, as vLLM's server does it: ``stream_options.include_usage`` adds a last chunk
with ``choices: []``; ``continuous_usage_stats`` (only with ``include_usage``) puts the text stage's
usage so far on every chunk, the role chunk counting the prompt and nothing generated.

vLLM-Omni's ``return_stage_metrics`` adds its ``metrics`` object (:mod:`.stage_metrics`) to every chunk
after the role chunk and to the non-streamed response.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field, Strict, ValidationInfo, field_validator, model_validator

from omni_serve.api.openai.errors import APIError, bad_request
from omni_serve.api.openai.messages import MediaRules, Message, MMProcessorKwargs, TextPart, Transcripts, _Strict
from omni_serve.api.openai.response_format import ResponseFormat, TextFormat, constraint
from omni_serve.api.openai.sampling import SamplingRequest
from omni_serve.api.openai.stage_metrics import metrics_json
from omni_serve.api.openai.tools import MAX_TOOLS, FunctionTool, ToolChoice, calls_json, delta_json, tool_calling
from omni_serve.media.encode import EMPTY_AUDIO_SAMPLE_RATE, AudioFormat, b64, encode_audio
from omni_serve.types import (
    ChatMessage,
    FinishReason,
    Modality,
    StageOutput,
    StructuredOutputs,
    TokenLogprob,
    ToolCallDelta,
    ToolCalling,
    Usage,
)

if TYPE_CHECKING:
    from starlette.requests import Request

    from omni_serve.api.openai.route import RouteContext
    from omni_serve.graph.request import OmniRequest
    from omni_serve.graph.stage_log import StageLog


ChatAudioFormat = Literal["wav", "mp3", "flac", "opus", "aac", "pcm16", "pcm"]


class AudioOptions(_Strict):
    voice: str | None = Field(None, description="Voice name or OpenAI alias; None uses the model's default voice.")
    format: ChatAudioFormat = Field("wav", description="Container of message.audio.data; pcm16 = raw 16-bit PCM.")

    @property
    def container(self) -> AudioFormat:
        return "pcm" if self.format == "pcm16" else self.format


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="A last chunk (choices: []) with the request's usage.")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: every chunk also carries the usage so far; only together with include_usage."
    )
    include_obfuscation: bool | None = Field(
        None, description="OpenAI's padding of streamed deltas against side channels; accepted, none is added."
    )

    @property
    def usage_on_every_chunk(self) -> bool:
        """vLLM's rule (``should_include_usage``): continuous usage needs ``include_usage`` too, else it is ignored."""
        return self.include_usage and self.continuous_usage_stats


class Prediction(_Strict):
    """OpenAI's predicted output: a latency hint that never changes the reply (accepted, not used)."""

    type: Literal["content"]
    content: str | list[TextPart]


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


# OpenAI's chat fields that would change the reply and cannot be honoured here, and why (the 400's message).
REFUSED = {
    "functions": "deprecated by OpenAI in favour of tools, which omni_serve honours: send tools",
    "function_call": "deprecated by OpenAI in favour of tool_choice, which omni_serve honours: send tool_choice",
    "reasoning_effort": "the served models have no reasoning effort to set",
    "verbosity": "the served models have no verbosity control",
    "web_search_options": "omni_serve has no web search",
    "moderation": "omni_serve runs no moderation model",
}


class ChatCompletionRequest(SamplingRequest):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    # Strict(False): an enum's JSON value is its string (strict python validation wants the member itself).
    modalities: list[Annotated[Modality, Strict(False)]] | None = Field(None, description="Default ['text'].")
    audio: AudioOptions | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, description="Choices per request: one (each would run the whole graph).")
    logprobs: bool | None = Field(None, description="Report each generated token's log-probability.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token; needs logprobs.")
    response_format: ResponseFormat | None = None
    # vLLM's extension: any of its structured-output constraints (json, regex, choice, grammar, ...).
    structured_outputs: StructuredOutputs | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that change nothing a client gets back here, accepted so clients that send them work
    # (docs/api.md, "Every chat field"): labels and hints for OpenAI's own storage, caching and routing.
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    metadata: dict[str, str] | None = None
    store: bool | None = Field(None, description="Only false: omni_serve keeps no completions.")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prediction: Prediction | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # OpenAI fields that would change the reply and cannot be honoured: refused by name (_refused).
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # vLLM-Omni's extensions, with its meaning (its example clients send them).
    voice: str | None = Field(None, description="The voice, as vLLM-Omni accepts it at the top level.")
    speaker: str | None = Field(None, description="vLLM-Omni's name for voice.")
    return_prompt_text: bool | None = Field(None, description="Add the templated prompt as 'prompt_text'.")
    return_stage_metrics: bool | None = Field(
        None, description="vLLM-Omni's: per-stage metrics as 'metrics' on the response and on every streamed chunk."
    )
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # Accepted for vLLM-Omni clients; they do not change this graph's output: vLLM-Omni's Qwen3-Omni
    # path drops language and instructions too (they are read by its TTS-model paths).
    language: str | None = None
    instructions: str | None = None

    @field_validator(*REFUSED)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(REFUSED[info.field_name or ""])
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(
                "one choice per request: each choice would run the whole graph (talker and code2wav too); "
                "send n requests with seeds seed, seed + 1, ... for vLLM's n"
            )
        return n

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store: bool | None) -> bool | None:
        if store:
            raise ValueError("omni_serve keeps no completions (only false is accepted)")
        return store

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and (
            len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())
        ):
            raise ValueError("at most 16 pairs, keys of at most 64 characters, values of at most 512")
        return metadata

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, modalities: list[Modality] | None) -> list[Modality] | None:
        if modalities is not None and not modalities:
            raise ValueError("must name at least one modality")
        return modalities

    @model_validator(mode="after")
    def _one_voice(self) -> ChatCompletionRequest:
        if len({v.lower() for v in self._voices().values()}) > 1:
            raise ValueError(f"{', '.join(self._voices())} name different voices; send one")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        if value is not None:
            value.kind()  # exactly one kind of constraint
            if not isinstance(info.data.get("response_format"), TextFormat | None):
                raise ValueError("response_format constrains the output too; send one of them")
        return value

    def tool_calling(self) -> ToolCalling | None:
        """The tools the entry stage may call (a 400 naming the field for what cannot be offered)."""
        return tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls)

    def client_field(self, sampling_field: str) -> str:
        if sampling_field == "structured_outputs" and self.response_format is not None:
            return "response_format"
        return sampling_field

    def _voices(self) -> dict[str, str]:
        named = {"audio.voice": self.audio.voice if self.audio else None, "voice": self.voice, "speaker": self.speaker}
        return {field: voice for field, voice in named.items() if voice}

    def requested_voice(self) -> tuple[str | None, str]:
        """The voice the client named (OpenAI's ``audio.voice`` or vLLM-Omni's ``voice``/``speaker``) and its field."""
        field, voice = next(iter(self._voices().items()), ("audio.voice", None))
        return voice, field

    def chat_messages(self, rules: MediaRules, transcripts: Transcripts | None = None) -> list[ChatMessage]:
        """The turns for the entry stage, media checked under ``rules`` (their bytes not decoded here), earlier
        audio replies named by id replaced by their transcripts (``transcripts``)."""
        self._check_tool_results()
        audio_in_video = bool(self.mm_processor_kwargs and self.mm_processor_kwargs.use_audio_in_video)
        messages = [m.chat_message(i, rules, audio_in_video, transcripts) for i, m in enumerate(self.messages)]
        parts = [p for m in messages for p in m.media()]
        if len(parts) > rules.limits.max_parts:
            extra = parts[rules.limits.max_parts].param
            raise bad_request(
                f"{extra}: more than {rules.limits.max_parts} media parts in one request (media_input.max_parts)",
                extra,
            )
        return messages

    def _check_tool_results(self) -> None:
        """A tool message answers a call of the assistant turn before it (tool messages between), as OpenAI requires."""
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id not in calls:
                param = f"messages.{i}.tool_call_id"
                raise bad_request(
                    f"{param}: '{message.tool_call_id}' answers no tool call of the assistant message before it", param
                )
            if message.role != "tool":
                calls = {call.id for call in message.tool_calls or []}

    def entry_sampling(self) -> dict[str, Any]:
        """The base's entry-stage sampling, with the chat-only fields that become sampling: logprobs and the
        structured-output constraint of response_format / structured_outputs."""
        sent = super().entry_sampling()
        extra = {
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            "structured_outputs": constraint(self.response_format, self.structured_outputs),
        }
        return sent | {name: value for name, value in extra.items() if value is not None}


# ---- the reply ------------------------------------------------------------------------------

# finish_reason ("stop" or "length": some stage stopped at its max_tokens) where a reply's body has no
# place for it: speech audio, a text-format transcript (omni_serve's header; OpenAI's APIs have none).
FINISH_REASON_HEADER = "X-Finish-Reason"

AUDIO_TTL_S = 3600


@dataclass
class ChatResult:
    """The merged final outputs of one request.

    Usage and finish reason are the text stage's (the one whose ``final_output`` is text),
    whether or not text was asked for; a graph without one finishes with ``stop``; the reply's
    finish reason is "length" as well when any other stage stopped at its max_tokens
    (``ChatReply._finish``). ``usage`` is
    the text stage's latest count: its outputs carry the usage so far, the finished one the total.
    """

    text_stage: str | None
    text: list[str] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)  # uint8 HxWx3
    sample_rate: int | None = None
    finish_reason: FinishReason = FinishReason.STOP
    usage: Usage = field(default_factory=Usage)
    prompt_text: str | None = None
    last_stage: str | None = None  # the stage of the latest output
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the text stage's, when asked for
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # the entry stage's calls, in pieces

    def add(self, output: StageOutput) -> None:
        self.last_stage = output.stage
        if output.text:
            self.text.append(output.text)
        if output.audio is not None:
            self.audio.append(output.audio)
            self.sample_rate = self.sample_rate or output.sample_rate
        self.images.extend(output.images)
        self.prompt_text = self.prompt_text or output.prompt_text
        if output.stage != self.text_stage:
            return
        self.logprobs.extend(output.logprobs or [])
        self.tool_calls.extend(output.tool_calls)
        if output.usage:
            self.usage = output.usage
        if output.finished:
            # The orchestrator never relays an aborted call as a finished output.
            assert output.finish_reason is not FinishReason.ABORT, "an aborted stage call reached the reply"
            self.finish_reason = output.finish_reason or FinishReason.STOP


def usage_json(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def logprobs_json(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object of a choice (or a chunk's share of it)."""

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

    return {"content": [{**token(e.token, e.logprob), "top_logprobs": [token(*t) for t in e.top]} for e in entries]}


def completion(
    request_id: str,
    model: str,
    created: int,
    result: ChatResult,
    modalities: set[Modality],
    audio_format: AudioFormat,
    *,
    prompt_text: bool = False,
    logprobs: bool = False,
    expires_at: int = 0,
) -> dict[str, Any]:
    text = "".join(result.text)
    calls = calls_json(result.tool_calls)
    content = text if Modality.TEXT in modalities and (text or not calls) else None  # a call alone: no content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if Modality.IMAGE in modalities:  # content becomes parts: the text (if any), then each image
        from omni_serve.api.openai.images import content_parts

        parts = [{"type": "text", "text": text}] if text and Modality.TEXT in modalities else []
        message["content"] = parts + content_parts(result.images)
    if Modality.AUDIO in modalities and (result.audio or not calls):  # a reply that only calls a tool says nothing
        samples = np.concatenate(result.audio) if result.audio else np.zeros(0, dtype=np.float32)
        rate = result.sample_rate or EMPTY_AUDIO_SAMPLE_RATE
        message["audio"] = {
            "id": f"audio-{request_id}",
            "data": b64(encode_audio(samples, rate, audio_format)),
            "expires_at": expires_at,
            "transcript": text,
        }
    elif Modality.AUDIO in modalities:
        message["audio"] = None
    if calls:
        message["tool_calls"] = calls
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": result.finish_reason.value,
        "logprobs": logprobs_json(result.logprobs) if logprobs else None,
    }
    body = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_json(result.usage),
    }
    if prompt_text:
        body["prompt_text"] = result.prompt_text
    return body


def chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    *,
    finish_reason: FinishReason | None = None,
    modality: Modality | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason.value if finish_reason else None}],
    }
    if modality is not None:
        body["modality"] = modality.value
    if usage is not None:
        body["usage"] = usage_json(usage)
    return body


def audio_delta(request_id: str, output: StageOutput, audio_format: AudioFormat) -> dict[str, Any]:
    assert output.audio is not None and output.sample_rate, "an audio output carries its sample rate"
    data = encode_audio(output.audio, output.sample_rate, audio_format)
    return {"audio": {"id": f"audio-{request_id}", "data": b64(data)}}


def transcript_delta(request_id: str, text: str) -> dict[str, Any]:
    return {"audio": {"id": f"audio-{request_id}", "transcript": text}}


def usage_chunk(request_id: str, model: str, created: int, usage: Usage) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, separators=(',', ':'))}\n\n"


@dataclass
class ChatReply:
    """One chat completion's reply, built from the graph's outputs: a JSON body, or SSE events."""

    request_id: str
    model: str
    modalities: set[Modality]
    audio_format: AudioFormat
    text_stage: str | None
    include_usage: bool = False  # a last chunk with the usage (stream_options.include_usage)
    usage_on_every_chunk: bool = False  # vLLM's continuous_usage_stats (StreamOptions.usage_on_every_chunk)
    prompt_text: bool = False
    logprobs: bool = False  # the request's logprobs: each choice (each chunk) carries the tokens' logprobs
    # What the request's stages did (the log the orchestrator records them into): a stage that stopped at
    # its max_tokens makes the finish_reason "length", whichever stage it was (a talker cut short too).
    stage_log: StageLog | None = None
    stage_metrics: bool = False  # vLLM-Omni's return_stage_metrics: the log as "metrics" on the reply
    # Keeps an audio reply's transcript under its audio id for later turns that name it (AudioReplies.remember).
    remember: Callable[[str, str, int], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    media_type = "text/event-stream"

    @property
    def expires_at(self) -> int:
        return self.created + AUDIO_TTL_S

    def decides_status(self, output: StageOutput) -> bool:
        return True  # the first output (or the end): a graph that starts answering answers 200

    async def json(self, outputs: AsyncIterator[StageOutput]) -> dict[str, Any]:
        result = ChatResult(self.text_stage)
        async for item in outputs:
            result.add(item)
        self._finish(result)
        # Encoding the reply's images and audio is CPU work: off the ingress event loop.
        body = await asyncio.to_thread(
            completion,
            self.request_id,
            self.model,
            self.created,
            result,
            self.modalities,
            self.audio_format,
            prompt_text=self.prompt_text,
            logprobs=self.logprobs,
            expires_at=self.expires_at,
        )
        if body["choices"][0]["message"].get("audio"):
            self._remember(result)
        return self._with_metrics(body, result)

    async def stream(self, outputs: AsyncIterator[StageOutput]) -> AsyncIterator[str]:
        request_id, model, created, modalities = self.request_id, self.model, self.created, self.modalities
        result = ChatResult(self.text_stage)
        pending: list[TokenLogprob] = []  # logprobs not sent yet: they go with the next text or call chunk

        def event(
            delta: dict[str, Any],
            modality: Modality | None = None,
            finish: FinishReason | None = None,
            tokens: bool = True,
        ) -> str:
            """One chunk; ``tokens``: it carries text (or calls, or the end), so the logprobs so far go with it."""
            usage = result.usage if self.usage_on_every_chunk else None
            logprobs = None
            if self.logprobs and tokens:
                logprobs, pending[:] = list(pending), []
            body = chunk(request_id, model, created, delta, finish_reason=finish, modality=modality, usage=usage)
            if logprobs is not None:
                body["choices"][0]["logprobs"] = logprobs_json(logprobs)
            return sse(self._with_metrics(body, result))

        first = await anext(outputs, None)
        counted = first.usage if first and first.stage == self.text_stage and first.usage else Usage()
        # As vLLM's first chunk: the prompt counted, nothing generated yet.
        usage = Usage(prompt_tokens=counted.prompt_tokens) if self.usage_on_every_chunk else None
        opening = chunk(request_id, model, created, {"role": "assistant", "content": ""}, usage=usage)
        if self.prompt_text:  # vLLM's field, on the first chunk only
            opening["prompt_text"] = first.prompt_text if first else None
        yield sse(opening)
        item = first
        spoke = False
        while item is not None:
            result.add(item)
            if item.stage == self.text_stage:
                pending.extend(item.logprobs or [])
            if item.text and Modality.TEXT in modalities:
                yield event({"content": item.text}, Modality.TEXT)
            elif item.text and Modality.AUDIO in modalities:  # audio only: the text is its transcript
                yield event(transcript_delta(request_id, item.text), Modality.AUDIO)
            if item.tool_calls and item.stage == self.text_stage:
                yield event({"tool_calls": [delta_json(piece) for piece in item.tool_calls]}, Modality.TEXT)
            if item.audio is not None:
                spoke = True
                yield event(audio_delta(request_id, item, self.audio_format), Modality.AUDIO, tokens=False)
            if item.images:  # content parts, as in the non-streamed message
                from omni_serve.api.openai.images import content_parts

                parts = await asyncio.to_thread(content_parts, item.images)  # PNG encoding: off the event loop
                yield event({"content": parts}, Modality.IMAGE, tokens=False)
            item = await anext(outputs, None)
        self._finish(result)
        yield event({}, finish=result.finish_reason)
        if spoke:
            self._remember(result)
        if self.include_usage:
            yield sse(self._with_metrics(usage_chunk(request_id, model, created, result.usage), result))
        yield sse("[DONE]")

    def _finish(self, result: ChatResult) -> None:
        """Every output is in: a reply any stage of which stopped at its max_tokens ends with "length"
        (an intermediate stage's outputs never reach the reply; its finish is in the stage log)."""
        if self.stage_log is not None and self.stage_log.cut_short():
            result.finish_reason = FinishReason.LENGTH

    def _remember(self, result: ChatResult) -> None:
        if self.remember is not None:
            self.remember(f"audio-{self.request_id}", "".join(result.text), self.expires_at)

    def _with_metrics(self, body: dict[str, Any], result: ChatResult) -> dict[str, Any]:
        """``body`` with vLLM-Omni's ``metrics`` as of now, when the request asked for them."""
        if self.stage_metrics and self.stage_log is not None:
            body["metrics"] = metrics_json(self.stage_log, result.last_stage)
        return body

    def headers(self, head: list[StageOutput]) -> dict[str, str]:
        return {}

    def in_band_error(self, error: APIError) -> str:
        """Headers are gone: the same error object as a JSON error, in band, and no ``[DONE]``, so
        nobody takes the truncated stream for success."""
        return sse(error.body())


async def chat_request(
    body: ChatCompletionRequest, http: Request, route: RouteContext, arrived: float | None = None
) -> tuple[OmniRequest, ChatReply]:
    """The chat body as the graph's request and its reply: the modalities the graph makes, the turns with their
    media checked (never decoded here: the entry stage decodes) and earlier audio replies named by id as their
    transcripts, the tools, and the voice (a voice the graph does not have is a 400 even when the reply has no
    audio, as vLLM-Omni refuses it)."""
    wanted = set(body.modalities or [Modality.TEXT])
    missing = wanted - route.modalities
    if missing:
        names = ", ".join(sorted(m.value for m in missing))
        offered = sorted(m.value for m in route.modalities)
        raise bad_request(f"modalities: this graph cannot produce {names} (it offers {offered})", "modalities")
    messages = body.chat_messages(route.media_rules, route.audio_replies.transcript)
    tools = body.tool_calling()
    voice = await route.voice(*body.requested_voice())
    omni = route.request(
        http,
        arrived,
        modalities=wanted,
        sampling=route.sampling(body),
        messages=messages,
        voice=voice if Modality.AUDIO in wanted else None,
        return_prompt_text=bool(body.return_prompt_text),
        tools=tools,
    )
    stream_options = body.stream_options or StreamOptions()
    reply = ChatReply(
        omni.request_id,
        route.model,
        wanted,
        body.audio.container if body.audio else "wav",
        route.text_stage,
        include_usage=stream_options.include_usage,
        usage_on_every_chunk=stream_options.usage_on_every_chunk,
        prompt_text=omni.return_prompt_text,
        logprobs=bool(body.logprobs),
        stage_log=omni.stage_log,
        stage_metrics=bool(body.return_stage_metrics),
        remember=route.audio_replies.remember,
    )
    return omni, reply
