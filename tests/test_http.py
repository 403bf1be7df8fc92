"""The wire under every route (omni_serve.api.http): multipart bodies held to their byte limit as they are read.

In process (Starlette's TestClient), no graph: what is tested is the reading, before any route's logic.
"""

from __future__ import annotations

from collections.abc import Iterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from omni_serve.api.http import read_form
from omni_serve.api.openai.errors import APIError

LIMIT = 4096


async def upload(request: Request) -> JSONResponse:
    try:
        fields, files = await read_form(request, LIMIT)
    except APIError as err:
        return JSONResponse({"error": err.message}, status_code=err.status)
    return JSONResponse({"fields": fields, "files": {k: len(v) for k, v in files.items()}})


CLIENT = TestClient(Starlette(routes=[Route("/upload", upload, methods=["POST"])]))
BOUNDARY = "omniboundary"
FORM = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def part(name: str, data: bytes) -> bytes:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.wav"\r\n'
    return head.encode() + b"Content-Type: audio/wav\r\n\r\n" + data + b"\r\n"


def body(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def chunked(data: bytes, size: int = 1024) -> Iterator[bytes]:
    """The body with no Content-Length (chunked): only what is read can tell its size."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_a_form_within_the_limit_is_read_whole() -> None:
    reply = CLIENT.post("/upload", content=chunked(body(part("file", b"a" * 1000))), headers=FORM)
    assert reply.status_code == 200, reply.text
    assert reply.json()["files"] == {"file": 1000}


def test_a_chunked_form_past_the_limit_is_413_even_when_each_file_is_under_it() -> None:
    """Two files of 3000 bytes: each under the 4096-byte limit, the body over it (was per file: accepted)."""
    two = body(part("file", b"a" * 3000), part("extra", b"b" * 3000))
    reply = CLIENT.post("/upload", content=chunked(two), headers=FORM)
    assert reply.status_code == 413, reply.text
    assert f"over {LIMIT} bytes" in reply.json()["error"]
    reply = CLIENT.post("/upload", content=chunked(body(part("file", b"a" * (LIMIT + 1)))), headers=FORM)
    assert reply.status_code == 413, reply.text


def test_a_json_route_refuses_a_body_without_a_content_type() -> None:
    """A cross-site fetch sends a string body as text/plain, a form's as a form: all need to say JSON (415)."""
    import pytest

    from omni_serve.api.http import check_content_type

    check_content_type("application/json; charset=utf-8")
    check_content_type("application/vnd.api+json")
    for content_type in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        with pytest.raises(APIError) as refused:
            check_content_type(content_type)
        assert refused.value.status == 415 and "application/json" in refused.value.message
