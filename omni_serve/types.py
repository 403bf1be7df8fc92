"""The contract that crosses deployment boundaries: plain typed structs and the errors a stage raises, no logic.

Everything a stage receives or yields is one of these. Small final results (text deltas, token
ids, audio for the client) travel inline; the heavy handoff for the next stage
(:class:`omni_serve.payload.HandoffPayload`) travels as its own item of the producing stage's
stream, an object the caller owns, and reaches the next stage as an ``ObjectRef``: never put into
the object store by the producer (:mod:`omni_serve.graph.transport` says why).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

RequestId = str
StageName = str


class Modality(str, enum.Enum):
    TEXT = "text"
    AUDIO = "audio"
    IMAGE = "image"
    VIDEO = "video"  # chat input (video content parts); a final output of video graphs (/v1/videos)


class FinishReason(str, enum.Enum):
    """Why a stage call ended; the value is the OpenAI ``finish_reason`` string."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"  # the reply ended in one or more tool calls (omni_serve.models.tool_calls)


class StructuredOutputs(BaseModel):
    """The entry stage's output constrained to a grammar: vLLM's ``StructuredOutputsParams``, one kind per request.

    OpenAI's ``response_format`` maps onto ``json`` (``json_schema``) or ``json_object``; vLLM's own
    ``structured_outputs`` extension may name any of them; ``structural_tag`` is also how a tool parser
    forces a tool call (``tool_choice`` ``required`` or named).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(
        None, alias="json", description="A JSON schema the output must match (vLLM's `json`)."
    )
    json_object: bool | None = Field(None, description="Any JSON object.")
    regex: str | None = Field(None, description="A regular expression the whole output must match.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's dialect).")
    structural_tag: str | None = Field(None, description="An xgrammar structural tag, as JSON text.")

    def kind(self) -> str:
        """The one constraint set (its vLLM name); raises ``ValueError`` unless exactly one is."""
        named = {
            "json": self.json_schema is not None,
            "json_object": bool(self.json_object),
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
            "structural_tag": self.structural_tag is not None,
        }
        chosen = [name for name, given in named.items() if given]
        if len(chosen) != 1:
            raise ValueError(f"exactly one kind of structured output, got {chosen or 'none'}")
        return chosen[0]


# Generation lengths above this are refused outright, on every route and in every stage's sampling
# (stages also cap at their context).
MAX_TOKENS_LIMIT = 1 << 20


class SamplingParams(BaseModel):
    """Sampling for one stage of one request: graph defaults merged with request overrides."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="0 disables top-k filtering.")
    max_tokens: int = Field(
        256, ge=1, le=MAX_TOKENS_LIMIT, description="Tokens (or codec frames) this stage may generate."
    )
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1.0 disables it.")
    seed: int | None = Field(None, description="Per-request seed; None draws one.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (text stages).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    # vLLM's extra sampling parameters, with vLLM's meaning and defaults. An engine family honours
    # some of them (``honoured_sampling`` of its module); a request or graph that sets one to anything
    # but its default on a stage whose engine does not honour it is refused, naming the field.
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top token's probability.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI presence penalty; 0 disables it.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI frequency penalty; 0 disables it.")
    min_tokens: int = Field(0, ge=0, description="Tokens generated before EOS, stop ids or stop strings may end it.")
    ignore_eos: bool = Field(False, description="Keep generating past the model's EOS token (benchmarks).")
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(True, description="Separate special tokens by spaces in the text.")
    bad_words: list[str] = Field(default_factory=list, description="Words never generated.")
    allowed_token_ids: list[int] | None = Field(None, description="Only these token ids may be generated.")
    logit_bias: dict[int, float] | None = Field(None, description="Token id -> bias added to its logit.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Report each generated token's log-probability and this many top alternatives."
    )
    structured_outputs: StructuredOutputs | None = Field(None, description="Constrain the output to a grammar.")

    @field_validator("structured_outputs")
    @classmethod
    def _one_kind(cls, value: StructuredOutputs | None) -> StructuredOutputs | None:
        if value is not None:
            value.kind()
        return value


# The fields above from min_p on: vLLM sampling parameters an engine family may or may not honour.
SAMPLING_EXTENSIONS: tuple[str, ...] = (
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "bad_words",
    "allowed_token_ids",
    "logit_bias",
    "logprobs",
    "structured_outputs",
)


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MediaPart(BaseModel):
    """A media item of a chat turn on its way to the entry stage: by reference, never decoded before it.

    ``data`` holds the bytes of a data URL (or ``input_audio``): the stage transport puts them into
    the object store and sends the ObjectRef (:mod:`omni_serve.graph.transport`); a remote or local
    URL travels as ``url`` and the entry stage fetches it under the graph's media policy.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    type: Literal["image", "audio", "video"]
    param: str  # the client's field, e.g. "messages.1.content.2": every error about this item names it
    data: Any = None
    url: str | None = None
    audio_in_video: bool = False  # video: its audio track is input too (vLLM-Omni's use_audio_in_video)


class ChatMessage(BaseModel):
    """One validated chat turn as the entry stage sees it: text, or parts when it carries media.

    An assistant turn that called tools carries its calls (``tool_calls``, OpenAI's shape: ``{id, type,
    function: {name, arguments}}``, ``arguments`` a JSON object once it parses, as vLLM hands them to the
    chat template); a ``tool`` turn is one call's result, named by ``tool_call_id``.
    """

    role: str
    content: str | list[TextPart | MediaPart]
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def media(self) -> list[MediaPart]:
        return [p for p in self.content if isinstance(p, MediaPart)] if isinstance(self.content, list) else []


class ImageParams(BaseModel):
    """Image-generation parameters for diffusion stages."""

    width: int
    height: int
    num_inference_steps: int | None = None  # None: the stage's default (its default_num_inference_steps)
    guidance_scale: float | None = None  # None: the stage's default
    negative_prompt: str | None = None
    seed: int | None = None
    n: int = 1


class ToolCalling(BaseModel):
    """The tools a request offers the entry stage, and how it may call them (OpenAI's chat fields).

    The entry stage parses its output with its model family's tool parser
    (:mod:`omni_serve.models.tool_calls`): the calls leave as :class:`ToolCallDelta` outputs, never as
    text, and never reach a downstream stage (the talker speaks only the text around them).
    """

    tools: list[dict[str, Any]] = Field(description="OpenAI function tools: {type: function, function: {...}}.")
    choice: Literal["auto", "none", "required"] = "auto"
    function: str | None = Field(None, description="tool_choice naming one function: it must be called.")
    parallel: bool = Field(True, description="parallel_tool_calls: False keeps at most one call.")


@dataclass
class ToolCallDelta:
    """A piece of one tool call as the entry stage parsed it: the call's ``id`` and ``name`` come with its
    first piece, then ``arguments`` text in order (OpenAI's streamed ``delta.tool_calls`` entry)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


# vLLM's floor for reported log-probabilities (its serving layer clamps -inf to it).
MIN_LOGPROB = -9999.0


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model (before any sampling transform), and the
    ``top`` most likely tokens at its position, most likely first (OpenAI's ``logprobs.content`` entry)."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


class VideoParams(BaseModel):
    """Video-generation parameters for diffusion stages (``/v1/videos``)."""

    width: int
    height: int
    num_frames: int
    fps: float
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str | None = None
    seed: int | None = None


class VideoRules(BaseModel):
    """What a video stage makes: its defaults and limits (the ingress checks a job's request against them)."""

    defaults: VideoParams  # what a request that names nothing gets (no seed)
    size_multiple: int  # width and height are multiples of it
    frame_multiple: int  # frame counts are frame_multiple x k + 1
    max_pixels: int
    max_frames: int
    max_inference_steps: int
    # The stage animates an image (image-to-video): every job carries one (``input_reference``), none otherwise.
    takes_image: bool = False


@dataclass
class StageRequest:
    """One call of one stage for one client request.

    The entry stage gets ``messages``; downstream stages get ``handoff``, an ObjectRef
    to the upstream :class:`HandoffPayload` (the replica resolves it, never the ingress), or
    ``handoffs``, one per upstream stage, when the stage reads several.

    ``request_id`` is minted by the orchestrator, unique per stage call (request, stage,
    chunk, attempt): engines may use it as their engine request id and abort key, and no
    client can choose or share it. The client's ``X-Request-ID`` travels only as a label.
    """

    request_id: RequestId
    sampling: SamplingParams
    messages: list[ChatMessage] | None = None
    handoff: Any = None  # ray.ObjectRef[HandoffPayload] | HandoffPayload (local tests)
    chunk_index: int = 0  # position of ``handoff`` in the upstream stage's stream
    wants_handoff: bool = True  # False when no downstream stage runs: engines may skip building one
    # True when the downstream call reads a stream of chunks (its ``stream_input``): an engine that can
    # yields its handoff in chunks as it decodes; one that cannot yields it whole (a stream of one chunk).
    stream_handoff: bool = False
    voice: str | None = None
    image: ImageParams | None = None
    video: VideoParams | None = None
    # Text-to-speech: the assistant reply to speak. The thinker teacher-forces it (one forward
    # pass, no sampling) so the talker gets the hidden states of exactly this text.
    text_to_speak: str | None = None
    # Text-to-speech on a TTS model: /v1/audio/speech's fields its prompt builder reads (vLLM-Omni's names:
    # instructions, task_type, language, ref_audio, ref_text, x_vector_only_mode), those the client set.
    speech: dict[str, Any] | None = None
    sent_at: float = 0.0  # wall-clock time the orchestrator dispatched this call (queue-wait metric)
    client_request_id: str | None = None  # the client's X-Request-ID: for logs only, never a key
    return_prompt_text: bool = False  # the entry stage adds the templated prompt to its first output
    # The messages' media, fetched and decoded (omni_serve.media.inputs) inside the entry stage replica
    # before its engine runs, in message order. Never sent across deployments.
    media: list[Any] | None = None
    # The entry stage: tools the request offers and how it may call them (None: no tool calling).
    tools: ToolCalling | None = None
    # A streamed call (its stage's ``stream_input``): the upstream's handoff chunks in this replica, in
    # order as they come (an AsyncIterator[HandoffPayload]); the engine gets no ``handoff`` then. Set by
    # the stage (omni_serve.graph.transport.receive), never sent across deployments.
    handoff_stream: Any = None
    # A fan-in call (its stage reads several upstream stages, ``inputs``): each one's final handoff, in the
    # order of ``inputs``. ObjectRefs on the wire; the stage resolves them (payloads), as it does ``handoff``.
    handoffs: list[Any] | None = None
    # Where this call waits for its caller to catch up when it runs a window ahead
    # (omni_serve.graph.flow.Window); None: the caller pulls each output itself (in process).
    window: Any = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class StageOutput:
    """One item a stage yields. A stage call yields one or more; the last has ``finished``."""

    stage: StageName
    text: str = ""  # text delta
    token_ids: list[int] = field(default_factory=list)  # token ids of this delta
    audio: np.ndarray | None = None  # float32 mono samples of this chunk
    sample_rate: int | None = None
    images: list[np.ndarray] = field(default_factory=list)  # uint8 HxWx3
    # A finished video: the MP4 file as a uint8 array inside the stage; like a handoff it leaves the
    # stage as its own stream item, owned by the caller, and the caller gets its ObjectRef.
    video: Any = None
    progress: float | None = None  # fraction of the call's work done (0..1), where the engine knows it
    handoff: Any = None  # HandoffPayload inside the engine, ObjectRef once it left the replica
    handoff_bytes: int = 0  # the handoff payload's array bytes, set where it is yielded (flow control)
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Token counts so far: text stages set them on every output (the ingress streams them as
    # vLLM's continuous usage); the finished output's are the call's totals.
    usage: Usage | None = None
    prompt_text: str | None = None  # the templated prompt, when the request asked for it
    # Text stages, when the request asked (``SamplingParams.logprobs``): one entry per token of ``token_ids``.
    logprobs: list[TokenLogprob] | None = None
    # The entry stage's tool calls parsed from its output (``StageRequest.tools``); ``text`` holds only the
    # rest of the reply.
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
