"""A request's sampling fields, as chat completions takes them: the one model every route that samples validates."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from omni_serve.api.openai.messages import _Strict
from omni_serve.types import MAX_TOKENS_LIMIT, SAMPLING_EXTENSIONS


class SamplingRequest(_Strict):
    """A request's sampling fields, as chat completions takes them (resolved per stage by
    :class:`omni_serve.api.sampling.StageSampling`).

    Every route that samples builds its request's sampling through this model, validated: chat
    completions (whose request is one), the realtime ``response.create`` and ``input_audio_transcription``,
    and transcriptions; so one set of bounds holds on every route (types.SamplingParams bounds each stage's
    values, ``max_tokens`` included).
    """

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM's -1, like 0, means no top-k filtering.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    # vLLM's extra sampling parameters (its OpenAI server accepts them at the top level; `vllm bench
    # serve` sends ignore_eos). They apply to the entry stage; types.SamplingParams has their meaning.
    # A stage whose engine cannot honour one that is sent refuses it with a 400 naming it.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    stage_sampling: dict[str, dict[str, Any]] | None = Field(
        None, description="Per-stage sampling overrides keyed by stage name, e.g. {'talker': {'temperature': 0.9}}."
    )
    # vLLM-Omni's extension, with its meaning (its example clients send it).
    sampling_params_list: list[dict[str, Any]] | None = Field(
        None, description="Per-stage vLLM SamplingParams by stage position (the graph's stage order)."
    )

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if len(values) > 4 or any(not s for s in values):
            raise ValueError("at most 4 non-empty stop strings")
        return stop

    @model_validator(mode="after")
    def _one_per_stage_form(self) -> SamplingRequest:
        if self.stage_sampling is not None and self.sampling_params_list is not None:
            raise ValueError("stage_sampling and sampling_params_list are two forms of the same thing; send one")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def entry_sampling(self) -> dict[str, Any]:
        """The top-level sampling fields the client sent, by ``types.SamplingParams`` name (entry stage)."""
        sent = {name: getattr(self, name) for name in _TOP_LEVEL_SAMPLING}
        sent["max_tokens"] = self.max_completion_tokens or self.max_tokens
        sent["stop"] = self.stop_list or None
        if sent["top_k"] == -1:
            sent["top_k"] = 0
        return {name: value for name, value in sent.items() if value is not None}

    def client_field(self, sampling_field: str) -> str:
        """The request field a top-level entry of ``entry_sampling`` came from (for errors naming it)."""
        return sampling_field


# Top-level request fields that are also types.SamplingParams fields of the same name.
_TOP_LEVEL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    *(name for name in SamplingRequest.model_fields if name in SAMPLING_EXTENSIONS or name == "stop_token_ids"),
)
