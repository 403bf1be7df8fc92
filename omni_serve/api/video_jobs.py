"""``/v1/videos`` jobs: run apart from the HTTP request that created them, results held by reference.

OpenAI's video API is asynchronous: ``POST /v1/videos`` answers at once with a job, the client polls
``GET /v1/videos/{id}`` and downloads ``/content`` when it completed. Each ingress replica starts one
:class:`VideoJobs` actor (no CPU, pinned to the replica's node, owned by the replica, named after it:
:data:`ACTOR_PREFIX` + the replica's actor id) that runs that replica's jobs and keeps their state:

- **A job is an ordinary graph request** (:class:`~omni_serve.graph.orchestrator.OmniRequest`), run by
  the actor's own orchestrator through the same serving template as every route (its outputs timed and
  any failure mapped once to the API error it would have been, which becomes the job's ``error``). It
  needs no HTTP connection: a client that disconnects after the create (or during it) leaves it running.
- **The result is never on the ingress's heap.** The stage encodes the MP4 and yields it as its own
  stream item (:mod:`omni_serve.graph.transport`), an object owned by this actor, which keeps only its
  ``ObjectRef``: videos over Ray's inline limit (100 KiB) sit in the node's shared-memory object store,
  smaller ones in this actor's in-process store. ``/content`` reads it by reference (zero-copy on the
  node) and streams it out.
- **Any ingress replica answers for any job.** Serve routes each HTTP request to any replica; the job id
  carries the actor's name, so a replica that did not create a job asks the actor that did.
- **Bounded per ingress replica** (the graph's ``videos``: :class:`~omni_serve.graph.config.VideoJobsConfig`):
  at most ``max_jobs`` jobs held (queued, running, finished and not yet expired) and ``max_bytes`` of
  finished videos; a create beyond either is refused with 429, a video that would pass ``max_bytes``
  fails its job. A finished or failed job expires ``ttl_s`` after it ended (``expires_at``) and its
  video is freed; a deleted one at once, and deleting a running job cancels its stage call, which
  aborts the engine request (:mod:`omni_serve.engines.ladder`).
- **Owned by the key that created it**: each job records a digest of the request's API key; any other
  key gets the same 404 as for a job that does not exist.
- **When an ingress replica dies**, its actor dies with it (Ray ends the actors a process owns), and with
  it that replica's jobs: their videos (owned by the actor) are freed and their running stage calls lose
  their caller and are cancelled; every replica then answers 404 for those ids. Jobs are not replicated:
  a client whose job vanished creates it again.

Every method runs on the actor's one event loop (an async actor): no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import secrets
import time
from typing import Any

from omni_serve.api.errors import from_failure
from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.videos import VideoJob, deleted, job_error, not_found
from omni_serve.api.serving import Serving
from omni_serve.graph.config import GraphConfig, load_graph
from omni_serve.graph.metrics import RequestMetrics
from omni_serve.graph.orchestrator import OmniRequest, Orchestrator
from omni_serve.graph.transport import RemoteStages, StageTransport

logger = logging.getLogger("ray.serve")

ACTOR_PREFIX = "omni_serve.videos:"
SWEEP_S = 5.0  # how often expired jobs are dropped while nobody asks
_ID = re.compile(r"^video_([0-9a-f]{32})([0-9a-f]{24})$")


def owner_of(authorization: str | None) -> str:
    """A digest of the request's API key (its bearer token; "" without one): whose jobs it sees."""
    _, _, token = (authorization or "").strip().partition(" ")
    return hashlib.sha256(token.strip().encode()).hexdigest()


def new_job_id(actor_key: str) -> str:
    """A job id naming the jobs actor that runs it (``actor_key``: 32 hex digits) and 96 random bits."""
    return f"video_{actor_key}{secrets.token_hex(12)}"


def actor_key_of(video_id: str) -> str | None:
    """The jobs actor key a job id names; None for an id this server never makes."""
    match = _ID.match(video_id)
    return match.group(1) if match else None


def reply(job: dict[str, Any] | None = None, error: APIError | None = None, **more: Any) -> dict[str, Any]:
    """What an actor method returns (exceptions with keyword fields do not survive Ray's pickling)."""
    if error is not None:
        fields = {k: getattr(error, k) for k in ("status", "message", "type", "param", "code", "retry_after_s")}
        return {"error": fields}
    return {"job": job, **more}


def unpack(answer: dict[str, Any]) -> dict[str, Any]:
    """The actor's answer, or the APIError it carries raised."""
    error = answer.get("error")
    if error is not None:
        raise APIError(error.pop("status"), error.pop("message"), **error)
    return answer


class VideoJobs:
    """The video jobs of one ingress replica (a Ray actor: see the module docstring)."""

    def __init__(self, graph: dict[str, Any] | GraphConfig, stages: Any):
        self.graph = load_graph(graph)
        self.limits = self.graph.videos
        transport: StageTransport = stages if isinstance(stages, StageTransport) else RemoteStages(stages)
        self.serving = Serving(Orchestrator(self.graph, transport), RequestMetrics())
        self.jobs: dict[str, VideoJob] = {}
        self.results: dict[str, Any] = {}  # job id -> the video's ObjectRef (the MP4 as a uint8 array)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    # ---- the routes' calls -------------------------------------------------------------------

    async def create(self, job: VideoJob, request: OmniRequest) -> dict[str, Any]:
        self._sweep()
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_every(SWEEP_S))
        if len(self.jobs) >= self.limits.max_jobs:
            return reply(error=_full(f"this server holds {len(self.jobs)} video jobs, its limit (videos.max_jobs)"))
        held = self.bytes_held()
        if held >= self.limits.max_bytes:
            return reply(error=_full(f"this server holds {held} bytes of videos, its limit (videos.max_bytes)"))
        self.jobs[job.id] = job
        self.tasks[job.id] = asyncio.create_task(self._run(job, request))
        return reply(job.json())

    def get(self, video_id: str, owner: str) -> dict[str, Any]:
        job = self._job(video_id, owner)
        return reply(error=not_found(video_id)) if job is None else reply(job.json())

    def content(self, video_id: str, owner: str) -> dict[str, Any]:
        """The finished video's ObjectRef, nested in a list so Ray passes the reference, not the bytes."""
        job = self._job(video_id, owner)
        if job is None:
            return reply(error=not_found(video_id))
        if job.status != "completed":
            message = f"video '{video_id}' is {job.status.replace('_', ' ')}: its content exists once it completed"
            return reply(error=APIError(409, message, type="invalid_request_error", param="video_id", code=job.status))
        return reply(job.json(), result=[self.results[video_id]])

    async def delete(self, video_id: str, owner: str) -> dict[str, Any]:
        """Forget the job and its video; a running job's stage call is cancelled first (its engine request aborted)."""
        job = self._job(video_id, owner)
        if job is None:
            return reply(error=not_found(video_id))
        task = self.tasks.pop(video_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._forget(video_id)
        return reply(deleted(video_id))

    def list(self, owner: str) -> list[dict[str, Any]]:
        self._sweep()
        return [job.json() for job in self.jobs.values() if job.owner == owner]

    def stats(self) -> dict[str, Any]:
        """Jobs by status, running tasks and the bytes of videos held (tests and operators)."""
        self._sweep()
        statuses = [job.status for job in self.jobs.values()]
        counts = {status: statuses.count(status) for status in ("queued", "in_progress", "completed", "failed")}
        return {**counts, "jobs": len(self.jobs), "tasks": len(self.tasks), "bytes": self.bytes_held()}

    # ---- the job ----------------------------------------------------------------------------

    async def _run(self, job: VideoJob, request: OmniRequest) -> None:
        video: Any = None
        try:
            async for output in self.serving.outputs(request, "videos"):
                if output.progress is not None:  # the engine admitted it (0), then its steps
                    job.status = "in_progress"
                    job.progress = max(job.progress, min(99, int(output.progress * 100)))
                if output.video is not None:
                    video = output.video
            if video is None:
                raise APIError(500, "the graph finished without a video", type="server_error", code="no_video")
            size = await _size_of(video)
            if self.bytes_held() + size > self.limits.max_bytes:
                raise _full(f"its {size}-byte video would pass the server's limit (videos.max_bytes)")
            self.results[job.id] = video
            job.result_bytes = size
            job.status, job.progress = "completed", 100
        except APIError as err:
            job.status, job.error = "failed", job_error(err)
        except Exception as err:  # nothing but APIError leaves serving.outputs: a bug here, never its text
            job.status, job.error = "failed", job_error(from_failure(err, request.request_id))
        finally:
            video = None
            self.tasks.pop(job.id, None)
        job.ended = time.time()
        job.completed_at = int(job.ended)
        job.expires_at = math.ceil(job.ended + self.limits.ttl_s)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _job(self, video_id: str, owner: str) -> VideoJob | None:
        self._sweep()
        job = self.jobs.get(video_id)
        return job if job is not None and secrets.compare_digest(job.owner, owner) else None

    def bytes_held(self) -> int:
        return sum(job.result_bytes for job in self.jobs.values() if job.id in self.results)

    def _forget(self, video_id: str) -> None:
        self.jobs.pop(video_id, None)
        self.results.pop(video_id, None)  # the last reference: Ray frees the video

    def _sweep(self) -> None:
        cutoff = time.time() - self.limits.ttl_s
        for video_id in [i for i, job in self.jobs.items() if job.ended is not None and job.ended <= cutoff]:
            self._forget(video_id)

    async def _sweep_every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            self._sweep()


def _full(why: str) -> APIError:
    return APIError(
        429,
        f"video jobs: {why}; retry once jobs expire (videos.ttl_s) or delete finished ones",
        type="rate_limit_error",
        code="video_jobs_full",
        retry_after_s=5,
    )


async def _size_of(video: Any) -> int:
    """The video's bytes: read by reference (zero-copy for an object in shared memory), then let go."""
    import ray

    value = await video if isinstance(video, ray.ObjectRef) else video
    return int(value.nbytes)
