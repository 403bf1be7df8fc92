"""API errors in OpenAI's JSON shape, and the one mapping from internal failures to HTTP status."""

from __future__ import annotations

import logging

from pydantic import ValidationError
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.responses import JSONResponse

from omni_serve.engines.base import InvalidStageInput
from omni_serve.orchestrator import StageFailed, StageTimeout

logger = logging.getLogger("ray.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param)


def from_validation(err: ValidationError) -> APIError:
    """The first problem names the field (dotted path) and says what is wrong with it."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if p not in ("body",)) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    value = first.get("input")
    shown = (
        ""
        if first["type"] in ("missing", "extra_forbidden") or isinstance(value, dict | list)
        else f" (got {value!r:.80})"
    )
    return bad_request(f"{param}: {message}{shown}" if param else message, param)


def from_failure(err: BaseException, request_id: str, log: bool = True) -> APIError:
    """Map a failed request to a status; never leak raw exception text of unexpected errors."""
    cause = err.cause if isinstance(err, StageFailed) else err
    # Ray re-raises a stage's exception as RayTaskError(<original>); its text is the remote traceback.
    while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) not in (None, cause):
        cause = cause.cause
    stage = getattr(err, "stage", None)
    if isinstance(cause, InvalidStageInput):
        return bad_request(str(cause) or "invalid input")
    if isinstance(err, StageTimeout):
        return APIError(504, f"{err}; request {request_id}", type="timeout_error")
    if isinstance(cause, BackPressureError):
        return APIError(503, f"stage '{stage}' is overloaded, retry later", type="overloaded_error", code="overloaded")
    if isinstance(cause, (DeploymentUnavailableError, RayActorError, ActorDiedError, ActorUnavailableError)):
        return APIError(503, f"stage '{stage}' is unavailable, retry later", type="service_unavailable")
    if log:
        logger.error("request %s failed in stage %s", request_id, stage, exc_info=err)
    return APIError(500, f"stage '{stage}' failed; see server logs for request {request_id}", type="server_error")
