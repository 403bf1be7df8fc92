"""How a stage call fails: every exception that crosses from a stage to the ingress, in one module.

Raised by the engines (bad input, an engine error, an engine that died), by the graph's walk and its
streamed handoffs (a stage that failed, went silent, ended short or aborted; chunks that never arrived),
and mapped once to the API's status by :mod:`omni_serve.api.failure_status`. Each is built from its
``args`` alone where it has fields, so Ray's pickling between deployments keeps them.
"""

from __future__ import annotations

# --- raised by an engine -----------------------------------------------------------------------------


class EngineError(RuntimeError):
    """The engine failed on a request for a reason that is not the client's fault."""


class EngineDeadError(EngineError):
    """The stage's engine can no longer serve (its EngineCore process or worker thread died); maps to 503.

    The replica that raised it fails its health check from then on, so Serve replaces it: a retry
    later reaches a fresh engine. ``reason`` is a short phrase of the engine family's own words, never
    an exception's text. Built from ``args`` alone, so Ray's pickling keeps both fields.
    """

    def __init__(self, stage: str, reason: str):
        super().__init__(stage, reason)
        self.stage = stage
        self.reason = reason

    def __str__(self) -> str:
        return f"stage {self.stage}: engine dead ({self.reason})"


class InvalidStageInput(ValueError):
    """The request is invalid for this engine (e.g. prompt longer than the context); maps to 400.

    ``param`` names the request field at fault as the client sent it (``messages``,
    ``input``, ``size``, ``messages.1.content.2``, ...); ``status`` is 400, or 413 for input over
    a size limit. Both survive Ray's pickling with the exception.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


# --- raised by the graph's walk (omni_serve.graph.orchestrator) --------------------------------------


class StageTimeout(TimeoutError):
    def __init__(self, stage: str, seconds: float, *, deadline: bool = False):
        super().__init__(
            f"the request reached its time limit while waiting for stage '{stage}'"
            if deadline
            else f"stage '{stage}' produced nothing for {seconds:.0f} s"
        )
        self.stage = stage


class StageFailed(RuntimeError):
    """A stage call failed; ``cause`` is the original error (Ray wraps engine errors)."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}")
        self.stage = stage
        self.cause = cause


class IncompleteStageStream(RuntimeError):
    """The stage's stream ended before its ``finished`` output (e.g. its replica went away)."""


class AbortedStageCall(RuntimeError):
    """The stage's engine finished the call with ABORT although nobody cancelled it."""


# --- raised by a streamed handoff's channel (omni_serve.graph.channel) -------------------------------


class ProducerFailed(RuntimeError):
    """The upstream stage call ended without its final handoff chunk (failed or cancelled)."""


class ChunksLost(ProducerFailed):
    """The stream ended before any chunk reached this call: a loss somewhere between the stages, not bad input.

    Every streamed call's first chunk is written before the call starts, so an empty stream is never
    what the upstream produced.
    """
