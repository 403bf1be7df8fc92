"""Errors in OpenAI's JSON shape (importable without Ray): the error object, 400s naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse


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


def renamed(error: APIError, param: str) -> APIError:
    """``error`` naming ``param`` instead of its field (another route's name for it), in its message too."""
    if error.param:
        error.message = error.message.replace(error.param, param, 1)
        error.param = param
    return error


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
