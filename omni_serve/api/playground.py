"""The playground (a page in the browser, served by the graph itself) and the stage report.

Routes, added to the ingress's FastAPI app by :func:`mount`:

- ``GET /`` redirects to ``playground/``; ``GET /playground/`` is the page, ``/playground/<file>``
  its script and style (``omni_serve/api/static/``: plain HTML/JS/CSS, no build step, no CDN), and
  ``/playground/info`` the audio formats the request models accept. All 404 when the graph args
  say ``playground: false``.
- ``GET /stages``: each deployment's status and replicas, from Serve's controller (never from a
  stage, so it answers while stages are busy or still loading). Needs the API key if one is set.

The page uses only the public HTTP API (``/v1/...``, ``/health``, ``/stages``) with the key the
person types. One ingress runs per replica process: :func:`configure` (called by the ingress
constructor) records its graph and auth check here, and starts the ready-line announcement.
"""

from __future__ import annotations

import asyncio
import enum
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, RedirectResponse, Response

from omni_serve.api.openai.chat import AudioOptions
from omni_serve.api.openai.errors import http_exception_handler
from omni_serve.api.openai.speech import SpeechRequest
from omni_serve.api.ready_line import announce_when_running
from omni_serve.graph.config import GraphConfig
from omni_serve.graph.readiness import ServeView

FILES = {"index.html": "text/html", "playground.js": "text/javascript", "playground.css": "text/css"}
NO_CACHE = {"cache-control": "no-cache"}  # a new version of the page shows on reload


@dataclass
class _Ingress:
    """What the routes need from this process's ingress (set by :func:`configure`)."""

    graph: GraphConfig | None = None
    check_auth: Callable[[Request], object] = lambda request: None  # raises APIError(401)
    view: ServeView | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


_ingress = _Ingress()
page = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
page.add_exception_handler(StarletteHTTPException, http_exception_handler)


def configure(graph: GraphConfig, check_auth: Callable[[Request], object], view: ServeView | None = None) -> None:
    """Called by the ingress constructor, on the replica's event loop (``view`` None: not in Serve)."""
    _ingress.graph, _ingress.check_auth, _ingress.view = graph, check_auth, view
    if view is None:
        return
    task = asyncio.get_running_loop().create_task(announce_when_running(graph, view))
    _ingress.tasks.add(task)
    task.add_done_callback(_ingress.tasks.discard)


def mount(api: FastAPI) -> None:
    api.add_api_route("/", _root, methods=["GET"], include_in_schema=False)
    api.add_api_route("/stages", stages, methods=["GET"])
    api.mount("/playground", page)


def _enabled() -> GraphConfig:
    if _ingress.graph is None or not _ingress.graph.playground:
        raise StarletteHTTPException(404, "the playground is off for this graph (args: playground: false)")
    return _ingress.graph


async def _root(request: Request) -> Response:
    _enabled()
    return RedirectResponse(f"{request.scope.get('root_path', '')}/playground/")


@page.get("/")
async def _index() -> Response:
    return await _file("index.html")


@page.get("/info")
async def _info() -> JSONResponse:
    _enabled()
    formats = {"chat_audio_formats": choices(AudioOptions, "format")}
    return JSONResponse({**formats, "speech_formats": choices(SpeechRequest, "response_format")})


@page.get("/{name}")
async def _file(name: str) -> Response:
    _enabled()
    if name not in FILES:
        raise StarletteHTTPException(404, f"no playground file '{name}'")
    body = resources.files("omni_serve.api").joinpath("static", name).read_bytes()
    return Response(body, media_type=FILES[name], headers=NO_CACHE)


async def stages(request: Request) -> JSONResponse:
    """Each deployment of this application: status, running/target replicas, Serve's message."""
    _ingress.check_auth(request)
    if _ingress.view is None:
        raise StarletteHTTPException(404, "no Serve application to report on")
    app = await _ingress.view.application()
    report = []
    for name, deployment in app.get("deployments", {}).items():
        replicas = [r.get("state") for r in deployment.get("replicas", [])]
        report.append(
            {
                "name": name,
                "status": deployment.get("status"),
                "running": replicas.count("RUNNING"),
                "starting": sum(state in ("STARTING", "UPDATING", "RECOVERING") for state in replicas),
                "target": deployment.get("target_num_replicas"),
                "message": deployment.get("message", ""),
            }
        )
    return JSONResponse({"application": _ingress.view.app_name, "status": app.get("status"), "stages": report})


def choices(model: type[BaseModel], name: str) -> list[str]:
    """The values a request-model field accepts (a Literal or an Enum, possibly Optional)."""

    def values(annotation: Any) -> list[str]:
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return [str(member.value) for member in annotation]
        if isinstance(annotation, str):
            return [annotation]
        return [v for arg in typing.get_args(annotation) for v in values(arg)]

    return values(model.model_fields[name].annotation)
