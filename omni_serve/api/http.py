"""The wire under every route: a JSON body or a multipart upload, read within its limit and parsed, or a clear 4xx."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import Message

from omni_serve.api.openai.errors import APIError, bad_request, from_validation
from omni_serve.media.inputs import check_format
from omni_serve.types import MediaPart

Body = TypeVar("Body", bound=BaseModel)


async def read_json(request: Request, limit: int, model: type[Body]) -> Body:
    """A JSON body (declared as such, within ``limit`` bytes) validated as ``model``."""
    check_content_type(request.headers.get("content-type"))
    return validated(model, parse_json_object(await read_body(request, limit)))


async def read_upload(request: Request, limit: int, model: type[Body]) -> tuple[Body, dict[str, bytes]]:
    """A multipart upload (within ``limit`` bytes): its text fields validated as ``model``, and its files."""
    fields, files = await read_form(request, limit)
    return validated(model, fields), files


async def read_json_or_form(
    request: Request, limit: int, model: type[Body], refuse_files: Callable[[dict[str, bytes]], None]
) -> Body:
    """A body a route takes as JSON or as a multipart form with the same fields (OpenAI's client sends the
    form), validated as ``model``; a form's files go to ``refuse_files`` (a route that reads none refuses them)."""
    if check_json_or_form(request.headers.get("content-type")):
        fields, files = await read_form(request, limit)
        refuse_files(files)
        return validated(model, dict(fields))
    return validated(model, parse_json_object(await read_body(request, limit)))


def check_json_or_form(content_type: str | None) -> bool:
    """Whether the body is a multipart form; a body neither JSON nor a form is a 415 naming both."""
    media = _media_type(content_type)
    if media == "multipart/form-data":
        return True
    try:
        check_content_type(media)
    except APIError:
        message = f"Content-Type must be application/json or multipart/form-data (got '{media or 'none':.60}')"
        raise APIError(415, message, type="invalid_request_error") from None
    return False


def validated(model: type[Body], data: dict[str, Any]) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise from_validation(err) from None


def upload(data: bytes | None, kind: Literal["audio", "image"], param: str, limit: int) -> tuple[MediaPart, str]:
    """One uploaded file as a media part (and its format): there, within ``limit`` bytes, in a format a ``kind``
    part accepts (sniffed). Never decoded here: it travels by reference to the entry stage, which decodes it."""
    if data is None:
        raise bad_request(f"{param}: an {kind} file is required (multipart field '{param}')", param)
    if len(data) > limit:
        raise APIError(
            413, f"{param}: {kind} over the limit of {limit} bytes", type="invalid_request_error", param=param
        )
    fmt = check_format(data, kind, param)  # InvalidStageInput: the ingress answers it as the 400 it names
    return MediaPart(type=kind, param=param, data=data), fmt


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only, declared as such: a body without a Content-Type is refused too.

    A browser sends a cross-site POST without asking first (no CORS preflight) only when its Content-Type is
    one of a form's (or missing: ``fetch`` with a string body sends ``text/plain``), so a page on any site
    could make a server on the user's machine run the model. Requiring ``application/json`` makes every such
    request need a preflight, which this server never grants. The official ``openai`` client, vLLM's
    benchmark client and the playground all send it.
    """
    media = _media_type(content_type)
    if media != "application/json" and not media.endswith("+json"):
        shown = media or "none"
        raise APIError(415, f"Content-Type must be application/json (got '{shown:.60}')", type="invalid_request_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (never buffered whole)."""
    return await _bounded(request, limit).body()


async def read_form(request: Request, limit: int) -> tuple[dict[str, str], dict[str, bytes]]:
    """A ``multipart/form-data`` body (OpenAI's audio, image and video uploads): its text fields and its files' bytes.

    Refused with 415 in another Content-Type and 413 once the body passes ``limit`` bytes, declared or
    read: Starlette's parser spools files (to disk past 1 MiB) as it reads, so the limit is enforced on
    what it is fed, the whole body, not on each file after the parse.
    """
    media = _media_type(request.headers.get("content-type"))
    if media != "multipart/form-data":
        shown = media or "none"
        raise APIError(
            415, f"Content-Type must be multipart/form-data (got '{shown:.60}')", type="invalid_request_error"
        )
    fields: dict[str, str] = {}
    files: dict[str, bytes] = {}
    async with _bounded(request, limit).form(max_files=4, max_fields=32) as form:
        for key, value in form.multi_items():
            if key in fields or key in files:  # one value a field: a second would silently replace the first
                raise bad_request(f"{key}: given more than once", key)
            if isinstance(value, str):
                fields[key] = value
            else:
                files[key] = await value.read()
    return fields, files


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def _bounded(request: Request, limit: int) -> Request:
    """``request`` whose body is refused with 413 past ``limit`` bytes: at once if its Content-Length says
    so, else as soon as what is read passes it (a chunked body has no length to trust)."""
    too_large = APIError(413, f"request body over {limit} bytes", type="invalid_request_error")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    seen = 0

    async def receive() -> Message:
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
        return message

    return Request(request.scope, receive)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object body; every malformed body is a 400 naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(f"request body is not valid UTF-8 (byte {err.start})") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise bad_request(f"request body is not valid JSON: {err.msg} at position {err.pos}") from None
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    except ValueError as err:  # e.g. an integer literal longer than Python's digit limit
        raise bad_request(f"request body is not valid JSON: {str(err)[:120]}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, not {type(data).__name__}")
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
