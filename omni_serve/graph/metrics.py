"""Prometheus metrics through Ray Serve's metrics API (exported as ``ray_<name>`` by each node's agent).

Serve tags every series with ``application``, ``deployment`` (= stage name) and ``replica``.
Stage series are recorded by the stage deployment for every call; request series by the
ingress for every client request.
"""

from __future__ import annotations

import time

from ray.serve.metrics import Counter, Gauge, Histogram

from omni_serve.types import StageOutput

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_RTF = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0]


class StageMetrics:
    """Per stage call: queue wait, processing time, units produced, calls in flight, outcome."""

    def __init__(self) -> None:
        self.queue_wait = Histogram(
            "omni_stage_queue_wait_seconds",
            description="Time from the orchestrator dispatching a stage call to the stage starting it.",
            boundaries=_LATENCY_S,
        )
        self.processing = Histogram(
            "omni_stage_processing_seconds",
            description="Time a stage call runs, from start to its last output.",
            boundaries=_LATENCY_S,
        )
        self.tokens = Counter(
            "omni_stage_tokens_total", description="Tokens (thinker) or codec frames (talker) generated."
        )
        self.audio = Counter("omni_stage_audio_seconds_total", description="Seconds of audio produced.")
        self.images = Counter("omni_stage_images_total", description="Images produced.")
        self.in_flight = Gauge("omni_stage_in_flight", description="Stage calls running in this replica.")
        self.calls = Counter("omni_stage_calls_total", description="Stage calls by outcome.", tag_keys=("outcome",))

    def output(self, output: StageOutput) -> None:
        # Ray counters reject increments of 0.
        if output.finished and output.usage and output.usage.completion_tokens > 0:
            self.tokens.inc(output.usage.completion_tokens)
        if output.audio is not None and output.sample_rate and len(output.audio):
            self.audio.inc(len(output.audio) / output.sample_rate)
        if output.images:
            self.images.inc(len(output.images))


class RequestMetrics:
    """Per client request: TTFT, time to first audio, end-to-end latency, real-time factor."""

    def __init__(self) -> None:
        def per_route(name: str, description: str, boundaries: list[float] = _LATENCY_S) -> Histogram:
            return Histogram(name, description=description, boundaries=boundaries, tag_keys=("route",))

        self.ttft = per_route("omni_request_ttft_seconds", "Time to the first text delta.")
        self.ttfa = per_route("omni_request_ttfa_seconds", "Time to the first audio chunk.")
        self.e2e = per_route("omni_request_e2e_seconds", "Request latency until the last output.")
        self.rtf = per_route("omni_request_rtf", "End-to-end latency / seconds of audio produced.", _RTF)
        self.requests = Counter(
            "omni_requests_total",
            description="Client requests by route and HTTP status.",
            tag_keys=("route", "status"),  # type: ignore[arg-type]  # Ray annotates tuple[str], takes any tuple
        )

    def timer(self, route: str) -> RequestTimer:
        return RequestTimer(self, route)


class RequestTimer:
    """Watches one request's outputs as they pass; ``done`` records the series once."""

    def __init__(self, metrics: RequestMetrics, route: str):
        self.metrics, self.tags = metrics, {"route": route}
        self.start = time.perf_counter()
        self.first_text: float | None = None
        self.first_audio: float | None = None
        self.audio_s = 0.0
        self.recorded = False

    def saw(self, output: StageOutput) -> None:
        now = time.perf_counter() - self.start
        if output.text and self.first_text is None:
            self.first_text = now
            self.metrics.ttft.observe(now, tags=self.tags)
        if output.audio is not None and output.sample_rate:  # audio outputs carry their rate
            if self.first_audio is None:
                self.first_audio = now
                self.metrics.ttfa.observe(now, tags=self.tags)
            self.audio_s += len(output.audio) / output.sample_rate

    def done(self, status: int) -> None:
        if self.recorded:
            return
        self.recorded = True
        e2e = time.perf_counter() - self.start
        self.metrics.requests.inc(tags={**self.tags, "status": str(status)})
        if status == 200:
            self.metrics.e2e.observe(e2e, tags=self.tags)
            if self.audio_s > 0:
                self.metrics.rtf.observe(e2e / self.audio_s, tags=self.tags)
