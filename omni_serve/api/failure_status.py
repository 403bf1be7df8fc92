"""The one mapping from a failed request (a stage, its replica, its engine, a time limit) to an API error."""

from __future__ import annotations

import logging
import math
import re

from ray.exceptions import ObjectLostError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException

from omni_serve.api.openai.errors import APIError
from omni_serve.exceptions import (
    AbortedStageCall,
    ChunksLost,
    EngineDeadError,
    IncompleteStageStream,
    InvalidStageInput,
    StageFailed,
    StageTimeout,
)

logger = logging.getLogger("ray.serve")


# Retry-After when the stage's backpressure_config names none: overload clears fast,
# a replacement replica takes a few seconds to start.
OVERLOADED_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 5


def _root_cause(err: BaseException) -> BaseException:
    """The original error: Ray re-raises a stage's exception as RayTaskError(<original>), and
    Serve wraps an upstream actor death in a RayServeException whose ``__cause__`` is it."""
    cause = err.cause if isinstance(err, StageFailed) else err
    for _ in range(8):
        if isinstance(cause, RayTaskError) and getattr(cause, "cause", None) not in (None, cause):
            cause = cause.cause
        elif type(cause) is RayServeException and isinstance(cause.__cause__, RayActorError):
            cause = cause.__cause__
        else:
            break
    return cause


# Ray's remote traceback text may prefix the message with the exception's class name.
_RAISED_AS = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?InvalidStageInput: ")
_FIELD = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*")


def stage_bad_request(cause: InvalidStageInput) -> APIError:
    """A stage's 400 (or 413): ``param`` is what the engine named, else the field its message starts with."""
    message = _RAISED_AS.sub("", str(cause)) or "invalid input"
    param = getattr(cause, "param", None)
    head, sep, _ = message.partition(":")
    if param is None and sep and _FIELD.fullmatch(head):
        param = head
    status = getattr(cause, "status", 400)
    return APIError(status if status in (400, 413) else 400, message, type="invalid_request_error", param=param)


def from_failure(err: BaseException, request_id: str, log: bool = True) -> APIError:
    """Map a failed request to a status; never leak raw exception text of unexpected errors.

    400 bad input · 503/429 overloaded (as the stage's ``backpressure_config`` says, with
    Retry-After) · 503 a stage replica or its engine died, its input was lost with it, the stage
    is unavailable, or its engine aborted the call (with Retry-After) · 504 a stage went silent
    or the request reached its time limit · 500 anything else. Every error has a ``code``,
    so a client reading an in-band stream error (no HTTP status) can still tell them apart.
    """
    cause = _root_cause(err)
    stage = getattr(err, "stage", None)
    if isinstance(cause, InvalidStageInput):
        return stage_bad_request(cause)
    if isinstance(err, StageTimeout):
        return APIError(504, f"{err}; request {request_id}", type="timeout_error", code="timeout")
    if isinstance(cause, BackPressureError):
        retry_after = cause.retry_after_s
        return APIError(
            cause.status_code if cause.status_code in (429, 503) else 503,
            f"stage '{stage}' is overloaded (its queue is full), retry later",
            type="overloaded_error",
            code="overloaded",
            retry_after_s=OVERLOADED_RETRY_AFTER_S if retry_after is None else max(0, math.ceil(retry_after)),
        )
    if isinstance(cause, AbortedStageCall):
        if log:
            logger.warning("request %s: stage %s aborted a call nobody cancelled", request_id, stage)
        return APIError(
            503,
            f"stage '{stage}' aborted the request, retry later",
            type="service_unavailable",
            code="stage_aborted",
            retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
        )
    if isinstance(cause, EngineDeadError):  # the replica fails its health check: Serve replaces it
        return APIError(
            503,
            f"stage '{stage}' engine died; retry later",
            type="service_unavailable",
            code="engine_dead",
            retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
        )
    if isinstance(
        cause, (DeploymentUnavailableError, RayActorError, ObjectLostError, IncompleteStageStream, ChunksLost)
    ):
        if log:
            logger.warning("request %s: stage %s unavailable: %s", request_id, stage, type(cause).__name__)
        return APIError(
            503,
            f"stage '{stage}' is unavailable (a replica was lost), retry later",
            type="service_unavailable",
            code="stage_unavailable",
            retry_after_s=UNAVAILABLE_RETRY_AFTER_S,
        )
    if log:
        logger.error("request %s failed in stage %s", request_id, stage, exc_info=err)
    return APIError(
        500,
        f"stage '{stage}' failed; see server logs for request {request_id}",
        type="server_error",
        code="stage_error",
    )
