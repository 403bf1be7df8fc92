"""vLLM-Omni's ``return_stage_metrics``: the chat reply's ``metrics`` object, from what the ingress measured.

What vLLM-Omni 0.30's server adds when a chat request sets it (``serving_chat.py`` and
``OmniBase._process_single_result``): on every streamed chunk of a final-output stage, ``metrics`` is
``{}`` until some stage has finished, then ``{"stage_metrics": {"<stage id>": {...}}}`` with an entry
for every stage finished so far; when the chunk's own stage has finished, its ``stage_id``,
``final_output_type``, ``num_tokens_in`` and ``num_tokens_out`` also sit at the top level. The
include_usage chunk and the non-streamed response carry the last such object. Its benchmark client
reads ``num_tokens_out``, ``finish_reason``, the audio counts and the timings below per stage.
A chunk reports what the log holds when the chunk is sent: the orchestrator records outputs as they
arrive, so ones still queued behind the chunk may already count.

Every value here is measured by omni_serve (:mod:`omni_serve.graph.stage_log`: the ingress's clock
from the request's arrival, and the counts the stages' outputs carry); a metric it does not measure
is left out rather than sent as 0: vLLM's engine-side ``vllm_ttft_ms``/``vllm_tpot_ms``/
``vllm_itls_ms``, ``postprocess_time_ms``, ``denoise_step_latency_ms``, ``image_time_to_first_output_ms``,
and token counts of a stage whose outputs carry no usage.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

from omni_serve.types import Modality

if TYPE_CHECKING:
    from omni_serve.graph.stage_log import StageLog, StageRecord


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _units(record: StageRecord) -> tuple[str, int] | None:
    """vLLM-Omni's ``output_unit_type`` and count: text tokens, audio samples, images, or a
    non-final stage's tokens (``stream``: a talker's codec frames)."""
    if record.final_output is Modality.AUDIO:
        return "audio", record.audio_samples
    if record.final_output is Modality.IMAGE:
        return "image", record.images
    if record.usage is None:
        return None
    return ("text" if record.final_output is Modality.TEXT else "stream"), record.usage.completion_tokens


def stage_json(record: StageRecord, start: float) -> dict[str, Any]:
    """One finished stage's entry, under vLLM-Omni's names."""
    assert record.first_call_at is not None and record.output_times, "a finished stage started and answered"
    last = record.output_times[-1]
    body: dict[str, Any] = {
        "stage_id": record.position,
        "stage_name": record.name,
        "final_output_type": record.final_output.value if record.final_output else None,
        # vLLM-Omni: the stage's submit to its finish; here its first call's start to its last output.
        "stage_gen_time_ms": _ms(last - record.first_call_at),
    }
    if record.finish_reason is not None:
        body["finish_reason"] = record.finish_reason.value
    if record.usage is not None:
        body["num_tokens_in"] = record.usage.prompt_tokens
        body["num_tokens_out"] = record.usage.completion_tokens
    units = _units(record)
    if units is not None:
        body["output_unit_type"], body["output_unit_count"] = units
    if record.first_output_at is not None:
        body["serving_time_to_first_output_ms"] = _ms(record.first_output_at - start)
        if units is not None and units[0] in ("text", "stream") and units[1] > 1:
            body["time_per_output_unit_ms"] = _ms((last - record.first_output_at) / (units[1] - 1))
    gaps = [later - earlier for earlier, later in pairwise(record.output_times)]
    body["inter_output_latencies_ms"] = [_ms(gap) for gap in gaps]
    if gaps:
        body["inter_output_latency_ms"] = _ms(sum(gaps) / len(gaps))
    if record.audio_samples and record.sample_rate:
        body["audio_frames"] = record.audio_samples
        body["audio_sample_rate"] = record.sample_rate
        body["audio_duration_s"] = record.audio_samples / record.sample_rate
    if record.images:
        body["image_pixels"] = record.image_pixels
    return body


def metrics_json(log: StageLog, stage: str | None = None) -> dict[str, Any]:
    """The ``metrics`` object as the reply sends it now; ``stage``: the stage whose output the chunk carries."""
    done = log.done_stages()
    if not done:
        return {}
    body: dict[str, Any] = {"stage_metrics": {str(r.position): stage_json(r, log.start) for r in done}}
    if stage is not None and log.done(stage):
        entry = body["stage_metrics"][str(log.stages[stage].position)]
        body.update({key: entry[key] for key in _TOP_LEVEL if key in entry})
    return body


# What vLLM-Omni repeats at the top level for the chunk's own (finished) stage.
_TOP_LEVEL = ("stage_id", "final_output_type", "num_tokens_in", "num_tokens_out")
