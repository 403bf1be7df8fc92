"""What one request's stages did, as the ingress saw it: each stage's calls and outputs, and when they came.

The orchestrator records into a request's log (every route's request carries one) at the two places
every stage call passes: where a call starts and where each of its outputs arrives, intermediate
stages included (a talker's codec chunks never reach the reply). The replies read two things from
it: which stages stopped at their ``max_tokens`` (a talker cut short makes a chat reply's
``finish_reason`` "length", :meth:`StageLog.cut_short`), and vLLM-Omni's ``return_stage_metrics``.
Times are the ingress's clock from the request's arrival at its route: they include the transport
between a stage's replica and the ingress, and nothing inside a replica (its queue, the engine's own
per-token timings) is seen here.

A stage is *done* for the request once every call of it finished and the stage feeding it is done,
so no further call can start: the stages vLLM-Omni's per-stage metrics report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omni_serve.types import FinishReason, Modality, StageOutput, Usage

if TYPE_CHECKING:
    from omni_serve.graph.config import GraphConfig


@dataclass
class StageRecord:
    """One stage of one request, summed over its calls (code2wav: one call per codec chunk)."""

    name: str
    position: int  # in the graph's stage list (vLLM-Omni's stage id; sampling_params_list's index)
    final_output: Modality | None
    upstream: list[str]  # its graph inputs
    calls: int = 0  # started
    finished_calls: int = 0
    first_call_at: float | None = None  # the first call's start
    first_output_at: float | None = None  # the first output with content (text, tokens, audio, images, a handoff)
    output_times: list[float] = field(default_factory=list)  # every output's arrival, in arrival order
    usage: Usage | None = None  # the finished calls' totals summed; None if no call reported usage
    finish_reason: FinishReason | None = None  # the latest finished call's
    cut_short: bool = False  # some call finished at its max_tokens (LENGTH)
    audio_samples: int = 0
    sample_rate: int | None = None
    images: int = 0
    image_pixels: int = 0


def _has_content(output: StageOutput) -> bool:
    return bool(output.text or output.token_ids or output.images) or (
        output.audio is not None or output.handoff is not None
    )


class StageLog:
    """The stages of one request, in graph order; times are ``clock()`` seconds, ``start`` the arrival."""

    def __init__(self, graph: GraphConfig, start: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.start = clock() if start is None else start
        self.stages = {
            s.name: StageRecord(s.name, position, s.final_output, list(s.inputs))
            for position, s in enumerate(graph.stages)
        }

    def started(self, stage: str) -> None:
        """A call of ``stage`` starts now."""
        record = self.stages[stage]
        record.calls += 1
        if record.first_call_at is None:
            record.first_call_at = self.clock()

    def saw(self, stage: str, output: StageOutput) -> None:
        """``output`` of a call of ``stage`` arrived now."""
        now = self.clock()
        record = self.stages[stage]
        record.output_times.append(now)
        if record.first_output_at is None and _has_content(output):
            record.first_output_at = now
        if output.audio is not None:
            record.audio_samples += len(output.audio)
            record.sample_rate = record.sample_rate or output.sample_rate
        record.images += len(output.images)
        record.image_pixels += sum(image.shape[0] * image.shape[1] for image in output.images)
        if output.finished:
            record.finished_calls += 1
            record.finish_reason = output.finish_reason or record.finish_reason
            record.cut_short = record.cut_short or output.finish_reason is FinishReason.LENGTH
            if output.usage is not None:  # a finished output carries its call's totals
                was = record.usage or Usage()
                record.usage = Usage(
                    was.prompt_tokens + output.usage.prompt_tokens,
                    was.completion_tokens + output.usage.completion_tokens,
                )

    def done(self, stage: str) -> bool:
        """Whether ``stage`` ran and can run no more for this request."""
        record = self.stages[stage]
        if record.calls == 0 or record.finished_calls < record.calls:
            return False
        return all(self.done(upstream) for upstream in record.upstream)

    def cut_short(self) -> list[str]:
        """The stages some call of which stopped at its ``max_tokens``, in graph order: the reply lacks their end."""
        return [name for name, record in self.stages.items() if record.cut_short]

    def settled(self, but: str) -> bool:
        """Whether every stage that ran, ``but`` one, is done: none of them can still be cut short."""
        return all(self.done(name) for name, record in self.stages.items() if record.calls and name != but)

    def done_stages(self) -> list[StageRecord]:
        return [record for name, record in self.stages.items() if self.done(name)]
