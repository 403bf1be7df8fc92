"""API errors in OpenAI's JSON shape, and the one mapping from internal failures to HTTP status."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from pydantic import ValidationError
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException
from starlette.responses import JSONResponse

from omni_serve.graph.orchestrator import AbortedStageCall, IncompleteStageStream, StageFailed, StageTimeout
from omni_serve.types import EngineDeadError, InvalidStageInput

logger = logging.getLogger("ray.serve")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s  # sent as Retry-After (429/503)

    def body(self) -> dict[str, Any]:
        # Messages may quote client input: lone surrogates would make the JSON unencodable.
        message, param = (_printable(v) for v in (self.message, self.param))
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers.setdefault("retry-after", str(self.retry_after_s))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


async def http_exception_handler(request: Any, err: Any) -> JSONResponse:
    """Starlette's own 404/405/... (unknown route, wrong method) in the OpenAI error shape."""
    status = getattr(err, "status_code", 500)
    return APIError(status, str(getattr(err, "detail", "error")), type="invalid_request_error").response(
        dict(getattr(err, "headers", None) or {})
    )


def _printable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param)


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A pydantic error location as the client's field path: union branch labels
    (``str``, ``list[tagged-union[...]]``) and discriminator tags are not fields."""
    path: list[str] = []
    tagged = False
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and ("[" in part or part in _BRANCH_LABELS):
            tagged = tagged or "tagged-union" in part
            continue
        if tagged and isinstance(part, str):  # the discriminator value pydantic puts in the path
            tagged = False
            continue
        path.append(str(part))
    return path


_BRANCH_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}


def from_validation(err: ValidationError) -> APIError:
    """The most specific problem names the field (dotted path) and says what is wrong with it.

    For a union (``content``: a string or a list of parts) pydantic reports one error per
    branch; the deepest one is the branch the client meant, equally deep ones are joined.
    """
    errors = err.errors()
    depth = max(len(_field_path(e["loc"])) for e in errors)
    deepest = [e for e in errors if len(_field_path(e["loc"])) == depth]
    first = deepest[0]
    param = ".".join(_field_path(first["loc"])) or None
    messages = []
    for e in deepest if depth and len({".".join(_field_path(e["loc"])) for e in deepest}) == 1 else [first]:
        text = e["msg"].removeprefix("Value error, ")
        messages.append("unknown field" if e["type"] == "extra_forbidden" else text)
    message = " or ".join(dict.fromkeys(messages))
    value = first.get("input")
    shown = (
        ""
        if first["type"] in ("missing", "extra_forbidden") or isinstance(value, dict | list)
        else f" (got {value!r:.80})"
    )
    return bad_request(f"{param}: {message}{shown}" if param else message, param)


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
    if isinstance(cause, (DeploymentUnavailableError, RayActorError, ObjectLostError, IncompleteStageStream)):
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
