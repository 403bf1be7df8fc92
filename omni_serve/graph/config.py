"""The graph config: stages, edges, engines and default sampling, validated once at build time.

This is the application ``args`` of a graph file. Replica counts, resources and
autoscaling are not here: they live in the Serve config's ``deployments:`` list,
matched by deployment name = stage name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from omni_serve.media.inputs import MediaInputConfig
from omni_serve.media.policy import MediaPolicy
from omni_serve.types import Modality, SamplingParams

EngineFamily = Literal["transformers", "vllm", "vllm_omni", "diffusers", "vllm_omni_diffusion"]

INGRESS_NAME = "ingress"
DEFAULT_CLIENT = "default"  # the client whose key api_key (or OMNI_SERVE_API_KEY) is

# The ingress ends a request this long before Serve's request_timeout_s, so the client gets the
# API's 504 error object instead of Serve's plain-text 408 (or a stream cut short).
DEADLINE_MARGIN_S = 2.0


class GraphConfigError(ValueError):
    """A graph file is invalid; the message names the offending field."""


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Stage name; also the Serve deployment name.", pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")
    engine: EngineFamily = Field(description="Engine family that runs this stage.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Arguments of the engine family, validated by the engine at start."
    )
    inputs: list[str] = Field(
        default_factory=list,
        description="Upstream stages whose handoffs this stage consumes; [] = the entry stage. Several (fan-in, as "
        "a vLLM-Omni stage with several input_sources): one call per request, started once every one of them "
        "finished, with each one's final handoff, in this order.",
    )
    final_output: Modality | None = Field(None, description="What this stage contributes to the client's reply.")
    stream_input: bool = Field(
        False,
        description="The edge from `input` streams: this stage's call starts on the upstream's first handoff chunk "
        "and reads the rest as the upstream produces them (waiting when it gets ahead), instead of starting from "
        "the upstream's final handoff. One call per request. Only for engines that read streamed input (the "
        "transformers talker, and the vllm_omni Qwen3-Omni talker through vLLM-Omni's async chunks: each family's "
        "reads_streamed_input); false: one call per upstream handoff (code2wav: one per codec chunk).",
    )
    default_sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="Sampling defaults; requests override them."
    )
    max_coalesce_ms: float = Field(
        50.0,
        ge=0.0,
        description="Longest a stage call merges its text deltas into one stream item. The interval in force is "
        "10 ms x the calls in flight in the replica, up to this; for a call that streams its handoff (the "
        "thinker of a streamed talker), after its first 8 outputs this, then twice as long per chunk up to 8 "
        "x this; 0 sends every delta as its own item (omni_serve.graph.coalesce).",
    )

    handoff_padding_bytes: int = Field(
        0,
        ge=0,
        description="Debug option for tests and benchmarks: add this many bytes to every handoff the stage yields "
        "(a tensor no engine reads; a streamed handoff: to its first chunk), so the tiny model moves "
        "production-sized handoffs (1-15 MB for Qwen3-Omni's thinker). 0 in every shipped graph.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "input" in data:
            raise ValueError("input: renamed inputs, a list (a stage may read several upstream stages)")
        return data

    @field_validator("name")
    @classmethod
    def _not_ingress(cls, name: str) -> str:
        if name == INGRESS_NAME:
            raise ValueError(f"'{INGRESS_NAME}' is reserved for the ingress deployment")
        return name


class RealtimeConfig(BaseModel):
    """Bounds of ``/v1/realtime`` sessions (each ingress replica holds its sessions' state): what one session may
    hold (bytes, items, audio), spend (events, bytes and audio seconds per second of wall time) and leave unread,
    and how many sessions one replica holds. Every breach is an ``error`` event (docs/realtime.md, Limits)."""

    model_config = ConfigDict(extra="forbid")

    max_session_minutes: float = Field(60.0, gt=0, description="A session is closed (1008) after this long.")
    max_sessions: int = Field(
        32,
        ge=1,
        description="Sessions one ingress replica holds at once; one more is refused (error event, close 1013). "
        "Each session, idle or not, is one of the ingress's max_ongoing_requests for its whole life: keep this "
        "below it, so HTTP requests keep room.",
    )
    max_buffered_audio_s: float = Field(
        120.0, gt=0, description="Uncommitted input audio a session may hold; an append beyond it is refused."
    )
    max_sessions_per_client: int | None = Field(
        16,
        ge=1,
        description="Sessions one client holds at once on one ingress replica (a client: its address, and the "
        "client its API key names when the graph sets keys); one more is refused (error event, close 1008). "
        "Half of max_sessions' default, so one client cannot take a replica's every session; null: no quota "
        "but max_sessions, for clients that share one address and key (docs/realtime.md, who a client is).",
    )
    idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A session whose client sent no event for this long, with no response running, is closed "
        "(error event, close 1008): an idle session holds its room and one of the ingress's max_ongoing_requests.",
    )
    max_items: int = Field(256, ge=2, description="Conversation items a session may hold.")
    max_session_config_bytes: int = Field(
        256 << 10,
        ge=4 << 10,
        description="The session's settings (instructions, tools, ...) as session.updated carries them; an update "
        "beyond it is refused. They go into every response's prompt: 256 KiB of text is more than the Qwen3-Omni "
        "thinker's whole context (65,536 tokens) reads.",
    )
    max_session_bytes: int = Field(
        32 << 20,
        ge=1 << 20,
        description="Bytes one session holds: its input audio buffer, its items' audio and text, its settings. "
        "Beyond it the audio the thinker no longer reads (assistant audio, user audio older than "
        "media_input.max_parts turns) is dropped, oldest first; what still does not fit is refused.",
    )
    max_event_bytes: int = Field(
        15 << 20, ge=1024, description="One client event's size (OpenAI's 15 MiB append limit); larger is refused."
    )
    events_per_second: float = Field(
        100.0, gt=0, description="Client events per second (bursts of twice this); faster ones are refused."
    )
    bytes_per_second: float = Field(
        8 << 20,
        gt=0,
        description="Bytes a session moves per second (bursts of max_session_bytes): each client event as "
        "received, the user audio each response carries to the graph, the item a retrieval and the settings a "
        "session.updated send back. "
        "Beyond it the event is refused. Bounds the ingress's parsing, coding and object-store work per session.",
    )
    audio_realtime_factor: float = Field(
        4.0,
        gt=0,
        description="Seconds of input audio a session may append per second of wall time (bursts of "
        "audio_burst_s); an append beyond it is refused. Bounds the server VAD's CPU per session.",
    )
    audio_burst_s: float = Field(30.0, gt=0, description="Input audio a session may append at once.")
    audio_workers: int = Field(
        2,
        ge=1,
        description="Threads per ingress replica that resample input audio and run the server VAD, off the "
        "event loop; a session's audio runs on one of them at a time, in order.",
    )
    max_pending_transcriptions: int = Field(
        4,
        ge=1,
        description="input_audio_transcription requests a session may have running or waiting; a turn committed "
        "beyond it is not transcribed (an error event and ...transcription.failed).",
    )
    max_unsent_bytes: int = Field(
        16 << 20,
        ge=1 << 20,
        description="Server events a session's client has not taken yet; beyond it the client is not reading and "
        "the session is closed (error event, close 1008). Seen only where the session's writes wait on the "
        "client; deployed on Serve 2.60 they were not seen to, behind either ingress (docs/realtime.md).",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="The graph's allowed_origins by its older name (when only sessions checked the Origin), "
        "kept working: joined with it, the one list for every route and the websocket. A run-time setting "
        "(the ingress's user_config realtime.allowed_origins changes it in place).",
    )

    @model_validator(mode="after")
    def _event_fits_the_byte_budget(self) -> RealtimeConfig:
        if self.max_event_bytes > self.max_session_bytes:  # the byte budget holds max_session_bytes at most
            raise ValueError(
                f"max_event_bytes ({self.max_event_bytes}) must not exceed max_session_bytes ({self.max_session_bytes})"
            )
        if self.max_session_config_bytes > self.max_session_bytes:  # the settings are bytes the session holds
            raise ValueError(
                f"max_session_config_bytes ({self.max_session_config_bytes}) must not exceed max_session_bytes "
                f"({self.max_session_bytes})"
            )
        return self


class VideoJobsConfig(BaseModel):
    """Bounds of the ``/v1/videos`` jobs one ingress replica holds (graphs with a video final output)."""

    model_config = ConfigDict(extra="forbid")

    max_jobs: int = Field(
        16,
        ge=1,
        description="Jobs one ingress replica holds at once (queued, running, and completed until they "
        "expire or are deleted; failed ones do not count); a create beyond it is refused with 429.",
    )
    max_bytes: int = Field(
        1 << 30,
        ge=1,
        description="Bytes of videos one ingress replica holds in the object store, counting each job in flight "
        "at its frames' raw size (an upper bound of its MP4) until its video is there; a create that would pass "
        "it is refused with 429 (a job admitted never fails for it).",
    )
    ttl_s: float = Field(
        3600.0,
        gt=0,
        description="A finished (or failed) job and its video expire this long after it ended "
        "(its expires_at); then every route answers 404 for it.",
    )
    job_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="Seconds a job may take from when it leaves the jobs' own queue until its video (its stage "
        "calls' silence limit too: a video stage may say nothing until its MP4); then it fails with 504's "
        "timeout. Not stage_timeout_s, and not Serve's request_timeout_s (a job has no HTTP request).",
    )
    max_running: int = Field(
        2,
        ge=1,
        description="Jobs one ingress replica hands to the video stage at once; the rest wait in its own queue "
        "(status queued), as do jobs the stage refuses as overloaded, until job_timeout_s.",
    )


class GraphConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(description="Model id reported by /v1/models and accepted in requests.")
    stages: list[StageConfig] = Field(min_length=1, description="The stages; order is only cosmetic.")
    api_key: str | None = Field(
        None,
        description="If set (or OMNI_SERVE_API_KEY is), requests need 'Authorization: Bearer <key>': the key of "
        "the client 'default' (omni_serve.api.auth). A graph Serve binds to a non-loopback address without a "
        "key does not start, unless allow_unauthenticated is set.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without an API key though Serve binds to a non-loopback address, on purpose (anyone "
        "who reaches the port runs the model; a warning at every start). False: such an ingress refuses to start.",
    )
    api_keys: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Clients and their keys (a name -> a key or a list of keys), beside api_key: a request's key "
        "names its client, which owns its video jobs; a client given new keys under its name (old and new listed "
        "while its users move) keeps its jobs.",
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host names requests may carry (Starlette TrustedHostMiddleware rules: names without the port, "
        "'*.example.com' for subdomains, '*' any); others get 400. None: only loopback names when Serve's "
        "http_options.host is a loopback address (DNS rebinding protection), else any.",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Browser Origins (e.g. 'https://app.example') whose pages may send requests that act (any "
        "method but GET/HEAD/OPTIONS, every route) and open realtime sessions, besides the server's own pages "
        "(same-origin: the Origin's host and port those of the request's Host); others get 403. '*' allows any; "
        "'null' may not be listed. Clients that send no Origin (not browsers) are not concerned. Joined with "
        "realtime.allowed_origins, its older name.",
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Request bodies above this size get 413.")
    stage_timeout_s: float = Field(
        100.0,
        gt=0,
        description="Seconds one stage call may stay silent before the request fails with 504; must stay below "
        f"Serve's http_options.request_timeout_s minus {DEADLINE_MARGIN_S:.0f} s (checked when the ingress starts).",
    )
    request_buffer_bytes: int = Field(
        4 << 20,
        ge=1 << 16,
        description="Bytes of stage outputs one request's walk may hold in the ingress for a client that reads "
        "slower than the stages produce; beyond, the stages are held back (omni_serve.graph.flow: the whole bound, "
        "and what adds to it).",
    )
    playground: bool = Field(True, description="Serve the browser playground at / (false: / and /playground/ are 404).")
    voice_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Other voice names clients may send (e.g. OpenAI's 'alloy') -> one of the graph's voices.",
    )
    refused_routes: dict[str, str] = Field(
        default_factory=dict,
        description="Routes the model refuses though its outputs would answer them -> why (the 400 a request gets): "
        "a vLLM-Omni pipeline's declared endpoint_restrictions, which generated graphs carry.",
    )
    media_policy: MediaPolicy = Field(
        default_factory=MediaPolicy,
        description="Where media URLs in requests may point (data URLs always work; remote and local URLs only "
        "as allowed here).",
    )
    media_input: MediaInputConfig = Field(
        default_factory=MediaInputConfig, description="Per-request limits on media parts; video sampling."
    )
    realtime: RealtimeConfig = Field(
        default_factory=RealtimeConfig, description="Limits of /v1/realtime sessions; the Origin allow-list."
    )
    videos: VideoJobsConfig = Field(
        default_factory=VideoJobsConfig, description="Limits of /v1/videos jobs (graphs with a video final output)."
    )
    engine_in_ingress: bool = Field(
        False,
        description="Graphs of one stage: run the stage's engine inside the ingress replicas instead of a deployment "
        "of its own, one Python hop less per request (Ray Serve LLM's direct streaming does the same). The stage then "
        "scales, and takes its resources, as the `ingress` deployment.",
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_as_lists(cls, clients: Any) -> Any:
        if not isinstance(clients, dict):
            return clients
        return {name: [keys] if isinstance(keys, str) else keys for name, keys in clients.items()}

    @model_validator(mode="after")
    def _one_client_a_key(self) -> GraphConfig:
        seen: dict[str, str] = {}
        for name, keys in self.clients().items():
            if not name or not keys or not all(keys):
                raise ValueError(f"api_keys.{name:.40}: a non-empty client name and one or more non-empty keys")
            for key in keys:
                if seen.setdefault(key, name) != name:
                    raise ValueError(f"api_keys.{name:.40}: a key of client '{seen[key]:.40}' too (a key names one)")
        return self

    @field_validator("voice_aliases")
    @classmethod
    def _lower_aliases(cls, aliases: dict[str, str]) -> dict[str, str]:
        return {alias.lower(): voice.lower() for alias, voice in aliases.items()}

    @model_validator(mode="after")
    def _one_origin_list(self) -> GraphConfig:
        """``allowed_origins`` and ``realtime.allowed_origins`` become one list, in both places: the HTTP routes
        read the first, realtime admission the second (omni_serve.api.hosts: why one list)."""
        joined = list(dict.fromkeys([*self.allowed_origins, *self.realtime.allowed_origins]))
        if "null" in joined:
            raise ValueError("allowed_origins: 'null' is any sandboxed page's or file's Origin; it may not be listed")
        self.allowed_origins = self.realtime.allowed_origins = joined
        return self

    @model_validator(mode="after")
    def _check_graph(self) -> GraphConfig:
        names = [s.name for s in self.stages]
        for i, stage in enumerate(self.stages):
            if names.count(stage.name) > 1:
                raise ValueError(f"stages[{i}].name: duplicate stage name '{stage.name}'")
            for upstream in stage.inputs:
                if upstream not in names:
                    raise ValueError(f"stages[{i}].inputs: unknown upstream stage '{upstream}' (stages: {names})")
            if len(set(stage.inputs)) != len(stage.inputs):
                raise ValueError(f"stages[{i}].inputs: an upstream stage named twice")
            if stage.stream_input and len(stage.inputs) != 1:
                raise ValueError(
                    f"stages[{i}].stream_input: a stage streams the input of exactly one upstream stage "
                    f"(it has {len(stage.inputs)})"
                )
        by_name = {s.name: s for s in self.stages}

        def cycle(path: list[str]) -> list[str] | None:
            for upstream in by_name[path[-1]].inputs:
                if upstream in path:
                    return [*path, upstream]
                found = cycle([*path, upstream])
                if found:
                    return found
            return None

        for i, stage in enumerate(self.stages):
            if found := cycle([stage.name]):
                raise ValueError(f"stages[{i}].inputs: cycle {' -> '.join(reversed(found))}")
        entries = [s.name for s in self.stages if not s.inputs]
        if len(entries) != 1:
            raise ValueError(f"stages: a graph needs exactly one entry stage (with no inputs), found {entries}")
        if not any(s.final_output for s in self.stages):
            raise ValueError("stages: no stage has a final_output, the graph would return nothing")
        if self.engine_in_ingress and any(s.final_output is Modality.VIDEO for s in self.stages):
            raise ValueError(
                "engine_in_ingress: a video graph's jobs run beside the ingress (omni_serve.api.video_jobs), which "
                "calls its stages as deployments: leave engine_in_ingress false"
            )
        if self.engine_in_ingress and len(self.stages) > 1:
            raise ValueError(
                f"engine_in_ingress: only a graph of one stage can run its engine in the ingress (this one has "
                f"{len(self.stages)}: each stage of a graph scales on its own deployment)"
            )
        # routes() reads the entry stage's engine args: only when there is something to check, so a bad engine
        # arg is reported where engine args are checked, naming the stage.
        if self.refused_routes and (unknown := sorted(set(self.refused_routes) - set(self.routes()))):
            raise ValueError(f"refused_routes: {unknown} are not routes omni_serve serves ({list(self.routes())})")
        return self

    @property
    def entry(self) -> StageConfig:
        return next(s for s in self.stages if not s.inputs)

    def clients(self) -> dict[str, list[str]]:
        """The graph's clients and their keys: ``api_keys``, with ``api_key`` among the client ``default``'s."""
        clients = {name: list(keys) for name, keys in self.api_keys.items()}
        default = clients.get(DEFAULT_CLIENT, [])
        if self.api_key is not None and self.api_key not in default:
            clients[DEFAULT_CLIENT] = [self.api_key, *default]
        return clients

    def deployment(self, stage: str) -> str:
        """The Serve deployment that runs ``stage``'s engine."""
        return INGRESS_NAME if self.engine_in_ingress else stage

    def stage(self, name: str) -> StageConfig:
        return next(s for s in self.stages if s.name == name)

    def children(self, name: str) -> list[StageConfig]:
        return [s for s in self.stages if name in s.inputs]

    @property
    def modalities(self) -> set[Modality]:
        return {s.final_output for s in self.stages if s.final_output}

    @property
    def input_modalities(self) -> list[Modality]:
        """What a chat message may carry: what the entry stage's engine takes (text at least)."""
        from omni_serve.engines import input_modalities

        entry = self.entry
        return input_modalities(entry.engine, entry.engine_args)

    @property
    def entry_prompt(self) -> str:
        """What the entry stage builds its prompt from: ``chat`` (a conversation; text to speak is teacher-forced as
        the reply), ``speech`` (the text to speak alone: a TTS model) or ``image`` (an image request: an AR stage
        planning for a DiT)."""
        from omni_serve.engines import entry_prompt

        return entry_prompt(self.entry.engine, self.entry.engine_args)

    def routes(self) -> dict[str, str | None]:
        """Every API route and whether this graph answers it: None, or why not (the 4xx a request gets).

        What a graph answers follows from its final outputs and what its entry stage takes: a TTS graph
        (audio out, text to speak in) speech; a speech-to-speech graph chat, realtime, transcriptions and
        speech; an image graph images and chat (the image as an image_url part; edits too where its entry stage
        takes images); a video graph videos.
        """
        out, takes = self.modalities, set(self.input_modalities)
        chat = self.entry_prompt == "chat"
        not_chat = (
            "its entry stage takes image requests, not a conversation (an AR stage planning for a DiT): use "
            "/v1/images/generations or /v1/images/edits"
            if self.entry_prompt == "image"
            else "its entry stage takes text to speak, not a conversation (a TTS model): use /v1/audio/speech"
        )

        def need(ok: bool, why: str) -> str | None:
            return None if ok else why

        audio_in = "its entry stage takes no audio"
        answered = {
            "/v1/chat/completions": (
                need(chat, not_chat)
                # chat carries text, audio and images (an image_url part, as vLLM-Omni's chat does); not videos
                or need(bool(out & {Modality.TEXT, Modality.AUDIO, Modality.IMAGE}), "it makes no text, audio or image")
            ),
            "/v1/audio/speech": need(Modality.AUDIO in out, "it produces no audio"),
            "/v1/audio/voices": need(Modality.AUDIO in out, "it produces no audio"),
            "/v1/realtime": need(chat, not_chat) or need(Modality.AUDIO in takes, audio_in),
            "/v1/audio/transcriptions": (
                need(chat, not_chat) or need(Modality.AUDIO in takes, audio_in) or need(Modality.TEXT in out, "no text")
            ),
            "/v1/images/generations": need(Modality.IMAGE in out, "it generates no images"),
            "/v1/images/edits": (
                need(Modality.IMAGE in out, "it generates no images")
                or need(Modality.IMAGE in takes, "its entry stage takes no images")
            ),
            "/v1/videos": need(Modality.VIDEO in out, "it generates no videos"),
        }
        return {route: why or self.refused_routes.get(route) for route, why in answered.items()}

    def stages_for(self, modalities: set[Modality]) -> set[str]:
        """Stages a request must run: producers of the wanted outputs and their upstreams."""
        needed: set[str] = set()
        todo = [s.name for s in self.stages if s.final_output in modalities]
        while todo:
            name = todo.pop()
            if name not in needed:
                needed.add(name)
                todo += self.stage(name).inputs
        return needed


def check_timeouts(stage_timeout_s: float, request_timeout_s: float | None) -> None:
    """``stage_timeout_s`` must fire before Serve's own request timeout can (a 504 in the API's shape
    instead of Serve's plain-text 408). Raises :class:`GraphConfigError` naming both settings."""
    if request_timeout_s is not None and stage_timeout_s > request_timeout_s - DEADLINE_MARGIN_S:
        raise GraphConfigError(
            f"invalid omni_serve graph: stage_timeout_s ({stage_timeout_s:g} s) must be at most "
            f"http_options.request_timeout_s ({request_timeout_s:g} s) minus {DEADLINE_MARGIN_S:g} s"
        )


def format_errors(err: ValidationError) -> str:
    """A pydantic error as one line per field, each led by the field's path."""
    lines = []
    for e in err.errors():
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc and not msg.startswith(("stages", loc)) else msg)
    return "; ".join(lines)


def load_graph(args: dict[str, Any] | GraphConfig) -> GraphConfig:
    """Validate application args; raise :class:`GraphConfigError` with one readable message."""
    if isinstance(args, GraphConfig):
        return args
    try:
        graph = GraphConfig.model_validate(args)
    except ValidationError as err:
        raise GraphConfigError(f"invalid omni_serve graph: {format_errors(err)}") from None
    from omni_serve.engines import (
        honoured_sampling,
        reads_streamed_input,
        unhonoured_sampling,
        validate_engine_args,
    )

    for i, stage in enumerate(graph.stages):
        problem = validate_engine_args(stage.engine, stage.engine_args)
        if problem:
            raise GraphConfigError(f"invalid omni_serve graph: stages[{i}].engine_args: {problem}")
        if stage.stream_input and not reads_streamed_input(stage.engine, stage.engine_args):
            raise GraphConfigError(
                f"invalid omni_serve graph: stages[{i}].stream_input: the {stage.engine} engine of stage "
                f"'{stage.name}' reads whole handoffs only"
            )
        for name in unhonoured_sampling(stage.default_sampling, honoured_sampling(stage.engine, stage.engine_args)):
            raise GraphConfigError(
                f"invalid omni_serve graph: stages[{i}].default_sampling.{name}: the {stage.engine} engine of "
                f"stage '{stage.name}' cannot honour it"
            )
    return graph
