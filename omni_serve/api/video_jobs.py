"""``/v1/videos`` jobs: run apart from the HTTP request that created them, results held by reference.

OpenAI's video API is asynchronous: ``POST /v1/videos`` answers at once with a job, the client polls
``GET /v1/videos/{id}`` and downloads ``/content`` when it completed. Each ingress replica starts one
:class:`VideoJobs` actor (no CPU, pinned to the replica's node, owned by the replica, named
:func:`actor_name`: :data:`ACTOR_PREFIX`, the Serve application's name and a random key) that runs that
replica's jobs and keeps their state:

- **A job is an ordinary graph request** (:class:`~omni_serve.graph.request.OmniRequest`), run by
  the actor's own orchestrator through the same serving template as every route (its outputs timed and
  any failure mapped once to the API error it would have been, which becomes the job's ``error``). It
  needs no HTTP connection: a client that disconnects after the create (or during it) leaves it running.
- **Its deadline is the job's** (the graph's ``videos``: :class:`~omni_serve.graph.config.VideoJobsConfig`):
  at most ``max_running`` jobs are in the video stage at once; the rest wait in the actor's own queue
  (``queued``), and so does a job the stage refuses as overloaded (it never reached the engine: it is asked
  again after the stage's Retry-After). From when a job leaves that queue, ``job_timeout_s`` bounds it whole,
  its stage calls' silence included: a Wan DiT says nothing between admitting a job and its MP4, so the
  graph's ``stage_timeout_s`` (a silence limit for replies with an HTTP request) is not a job's.
- **The result is never on the ingress's heap.** The stage encodes the MP4 and yields it as its own
  stream item (:mod:`omni_serve.graph.transport`), an object owned by this actor, which keeps only its
  ``ObjectRef``: videos over Ray's inline limit (100 KiB) sit in the node's shared-memory object store,
  smaller ones in this actor's in-process store. ``/content`` reads it by reference (zero-copy on the
  node) and streams it out.
- **Any ingress replica answers for any job.** Serve routes each HTTP request to any replica; the job id
  carries the actor's key, so a replica that did not create a job asks the actor that did (found by name in
  its own application: another application's jobs are never listed nor asked).
- **Bounded per ingress replica**: at most ``max_jobs`` jobs queued, running or completed (until they
  expire or are deleted), and ``max_bytes`` of videos, a job in flight counted at :func:`mp4_bound` of its
  frames (their raw 4:2:0 samples, which the encoder's H.264 does not exceed) until its video is there, then
  at the MP4's size: a create beyond either is refused with 429, and a job admitted never fails for them.
  A failed job holds no slot: it is kept to be read until it expires, at most ``max_jobs`` of them (the
  oldest failed goes first). A finished or failed job expires ``ttl_s`` after it ended (``expires_at``) and
  its video is freed; a deleted one at once, and deleting a running job cancels its stage call, which
  aborts the engine request (:mod:`omni_serve.engines.ladder`).
- **Owned by the client that created it** (:func:`owner_of`): the client its API key names
  (:mod:`omni_serve.api.auth`), so a client's rotated keys keep its jobs; any other client gets the same
  404 as for a job that does not exist. On a graph with no key, jobs stay apart by the bearer token sent.
- **Run-time settings reach it**: the ingress replica hands the ``videos`` limits of a new ``user_config``
  to its actor (:meth:`VideoJobs.reconfigure`); jobs admitted after it get them.
- **Job records live in the actor and die with it**, videos included (the actor owns them: they could not
  outlive it). When an ingress replica dies its actor dies with it (Ray ends the actors a process owns);
  when an actor dies under a living replica, the replica's next create finds it dead and starts a new one
  under a new key. Either way the lost jobs' ids name an actor that no longer exists, and every replica
  answers them 404 ``video_not_found`` (never a 500); their running stage calls lose their caller and are
  cancelled. Jobs are not replicated: a client whose job vanished creates it again.

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
import uuid
from typing import Any

from omni_serve.api.auth import ANONYMOUS
from omni_serve.api.failure_status import from_failure
from omni_serve.api.openai.errors import APIError
from omni_serve.api.openai.videos import VideoJob, deleted, job_error, not_found, video_list
from omni_serve.api.serving import Serving
from omni_serve.exceptions import StageFailed
from omni_serve.graph.config import GraphConfig, load_graph
from omni_serve.graph.metrics import RequestMetrics
from omni_serve.graph.orchestrator import Orchestrator
from omni_serve.graph.request import OmniRequest
from omni_serve.graph.transport import RemoteStages, StageTransport
from omni_serve.types import Modality, VideoParams, VideoRules

logger = logging.getLogger("ray.serve")

ACTOR_PREFIX = "omni_serve.videos:"
SWEEP_S = 5.0  # how often expired jobs are dropped while nobody asks
MP4_OVERHEAD = 64 << 10  # the container's and the stream's headers, beyond the frames' samples
_KEY = re.compile(r"^[0-9a-f]{32}$")
_ID = re.compile(r"^video_([0-9a-f]{32})([0-9a-f]{24})$")
_IN_FLIGHT = ("queued", "in_progress")


def owner_of(client: str, authorization: str | None) -> str:
    """Whose jobs a request sees: its client's (the name its key has, :func:`~omni_serve.api.auth.check_auth`);
    on a graph with no key, a digest of its bearer token (any token: jobs stay apart by it, unchecked)."""
    if client != ANONYMOUS:
        return f"client:{client}"
    _, _, token = (authorization or "").strip().partition(" ")
    return f"token:{hashlib.sha256(token.strip().encode()).hexdigest()}"


def actor_name(app: str, key: str) -> str:
    """The name of the jobs actor ``key`` (32 hex digits) of the Serve application ``app``."""
    return f"{ACTOR_PREFIX}{app}:{key}"


def actor_key_in(name: object, app: str) -> str | None:
    """The key of a jobs actor of ``app`` named ``name``; None for any other actor (another app's too)."""
    prefix = actor_name(app, "")
    if not isinstance(name, str) or not name.startswith(prefix):
        return None
    key = name[len(prefix) :]
    return key if _KEY.match(key) else None


def new_job_id(actor_key: str) -> str:
    """A job id naming the jobs actor that runs it (``actor_key``: 32 hex digits) and 96 random bits."""
    return f"video_{actor_key}{secrets.token_hex(12)}"


def actor_key_of(video_id: str) -> str | None:
    """The jobs actor key a job id names; None for an id this server never makes."""
    match = _ID.match(video_id)
    return match.group(1) if match else None


def mp4_bound(params: VideoParams) -> int:
    """An upper bound of a job's MP4 in bytes: its frames' 4:2:0 samples (what the stage's H.264 encodes,
    omni_serve.media.encode; uniform noise codes to about 70% of them at its CRF 18) and the headers."""
    return params.width * params.height * params.num_frames * 3 // 2 + MP4_OVERHEAD


def jobs_graph(graph: GraphConfig) -> dict[str, Any]:
    """The graph a jobs actor is built with: no keys (it never checks one, and its args should not carry them)."""
    return graph.model_dump(mode="json", exclude={"api_key", "api_keys"})


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
        # A job's stage calls may stay silent as long as the job may take (the module docstring).
        orchestrator = Orchestrator(self.graph, transport, self.limits.job_timeout_s)
        self.serving = Serving(orchestrator, RequestMetrics())
        self.jobs: dict[str, VideoJob] = {}
        self.results: dict[str, Any] = {}  # job id -> the video's ObjectRef (the MP4 as a uint8 array)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.waiting: list[str] = []  # the queued jobs not yet handed to the stage, first come first
        self.running = 0  # jobs handed to the stage (at most limits.max_running)
        self._changed = asyncio.Event()  # set (and replaced) when a job leaves the queue or the stage, or limits change
        self._sweeper: asyncio.Task[None] | None = None

    def reconfigure(self, graph: dict[str, Any]) -> None:
        """The ingress's new run-time settings (omni_serve.graph.settings): the limits of jobs admitted after."""
        self.graph = load_graph(graph)
        self.limits = self.graph.videos
        self.serving.orchestrator.stage_timeout_s = self.limits.job_timeout_s
        self._sweep()
        self._wake()  # max_running may have grown

    # ---- the routes' calls -------------------------------------------------------------------

    async def create(self, job: VideoJob, request: OmniRequest) -> dict[str, Any]:
        self._sweep()
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_every(SWEEP_S))
        held = sum(1 for j in self.jobs.values() if j.status != "failed")
        if held >= self.limits.max_jobs:
            return reply(error=_full(f"this server holds {held} video jobs, its limit (videos.max_jobs)"))
        needs, used = mp4_bound(job.params), self.bytes_held()
        if used + needs > self.limits.max_bytes:
            why = f"this server holds or reserved {used} bytes of videos and this one may take {needs}"
            return reply(error=_full(f"{why}, past its limit (videos.max_bytes)"))
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

    def page(self, owner: str, limit: int, descending: bool, after: list[Any] | None = None) -> list[list[Any]]:
        """The first ``limit`` of the owner's jobs in (created_at, id) order past ``after`` (a job's position,
        :meth:`position`), as positions: a list call merges every actor's and then asks for those jobs only."""
        self._sweep()
        cursor = tuple(after) if after is not None else None
        mine = [(job.created_at, job.id) for job in self.jobs.values() if job.owner == owner]
        if cursor is not None:
            mine = [p for p in mine if (p < cursor if descending else p > cursor)]
        return [list(p) for p in sorted(mine, reverse=descending)[:limit]]

    def position(self, video_id: str, owner: str) -> list[Any] | None:
        """Where the owner's job sits in a list ([created_at, id]); None for a job it cannot see."""
        job = self._job(video_id, owner)
        return None if job is None else [job.created_at, job.id]

    def listed(self, video_ids: list[str], owner: str) -> list[dict[str, Any]]:
        """The owner's jobs among ``video_ids`` (a page's: at most 100), in that order."""
        return [job.json() for video_id in video_ids if (job := self._job(video_id, owner)) is not None]

    def stats(self) -> dict[str, Any]:
        """Jobs by status, tasks, jobs in the stage and waiting here, and the bytes of videos held or reserved."""
        self._sweep()
        statuses = [job.status for job in self.jobs.values()]
        counts = {status: statuses.count(status) for status in ("queued", "in_progress", "completed", "failed")}
        return {
            **counts,
            "jobs": len(self.jobs),
            "tasks": len(self.tasks),
            "running": self.running,
            "waiting": len(self.waiting),
            "bytes": self.bytes_held(),
        }

    # ---- the job ----------------------------------------------------------------------------

    async def _run(self, job: VideoJob, request: OmniRequest) -> None:
        video: Any = None
        try:
            await self._turn(job)
            try:
                video = await self._render(job, request)
            finally:
                self.running -= 1
                self._wake()
            size = await _size_of(video)
            if size > mp4_bound(job.params):  # kept all the same: a job admitted never fails for max_bytes
                logger.warning(
                    "video job %s: its MP4 (%d bytes) passed its bound %d", job.id, size, mp4_bound(job.params)
                )
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
        self._drop_failed_beyond(self.limits.max_jobs)

    async def _turn(self, job: VideoJob) -> None:
        """Wait in this actor's queue until ``job`` is first and the stage has room for it (max_running)."""
        self.waiting.append(job.id)
        try:
            while self.waiting[0] != job.id or self.running >= self.limits.max_running:
                await self._changed.wait()
        finally:
            self.waiting.remove(job.id)  # its turn, or deleted while it waited: the next one may go
            self._wake()
        self.running += 1  # no await since the check: nobody took the room meanwhile

    def _wake(self) -> None:
        """Every waiting job checks again whether its turn came."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _render(self, job: VideoJob, request: OmniRequest) -> Any:
        """The job's video (its ObjectRef) within job_timeout_s; a stage that refuses it as overloaded never took
        it (Serve's queue was full): the job stays queued and asks again after the stage's Retry-After."""
        timeout_s = self.limits.job_timeout_s
        request.deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self._attempt(job, request)
            except APIError as err:
                if err.code == "timeout":
                    raise APIError(
                        504,
                        f"the job took longer than videos.job_timeout_s ({timeout_s:g} s)",
                        type="timeout_error",
                        code="timeout",
                    ) from None
                wait_s = max(1.0, float(err.retry_after_s or 1))
                if err.code != "overloaded" or time.monotonic() + wait_s >= request.deadline:
                    raise
            await asyncio.sleep(wait_s)

    async def _attempt(self, job: VideoJob, request: OmniRequest) -> Any:
        video: Any = None
        async for output in self.serving.outputs(request, "videos"):
            if output.progress is not None:  # the engine admitted it (0), then its steps
                job.status = "in_progress"
                job.progress = max(job.progress, min(99, int(output.progress * 100)))
            if output.video is not None:
                video = output.video
        if video is None:
            raise APIError(500, "the graph finished without a video", type="server_error", code="no_video")
        return video

    # ---- bookkeeping ------------------------------------------------------------------------

    def _job(self, video_id: str, owner: str) -> VideoJob | None:
        self._sweep()
        job = self.jobs.get(video_id)
        return job if job is not None and secrets.compare_digest(job.owner, owner) else None

    def bytes_held(self) -> int:
        """The completed jobs' videos, and the bound of each job in flight (its video is not there yet)."""
        done = sum(job.result_bytes for job in self.jobs.values() if job.id in self.results)
        return done + sum(mp4_bound(job.params) for job in self.jobs.values() if job.status in _IN_FLIGHT)

    def _forget(self, video_id: str) -> None:
        self.jobs.pop(video_id, None)
        self.results.pop(video_id, None)  # the last reference: Ray frees the video

    def _drop_failed_beyond(self, kept: int) -> None:
        """Failed jobs hold no slot; the oldest go past ``kept`` of them (each holds its prompt)."""
        failed = sorted((job.ended or 0.0, video_id) for video_id, job in self.jobs.items() if job.status == "failed")
        for _, video_id in failed[: max(0, len(failed) - kept)]:
            self._forget(video_id)

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


class JobsClient:
    """An ingress replica's side of the jobs: its own :class:`VideoJobs` actor, started on first use (and again
    once it died), and the other replicas' actors, found by name, each asked for the jobs its key names."""

    def __init__(self, app: str, graph: GraphConfig, stages: dict[str, Any]):
        self.app = app  # this Serve application's name: its actors' names carry it
        self.stages = stages  # the stage deployments' handles: the actor calls the video stage with them
        self.settings = jobs_graph(graph)  # the actor's graph: the args, with the run-time settings over them
        self._video_stage = next((s.name for s in graph.stages if s.final_output is Modality.VIDEO), None)
        self._rules: VideoRules | None = None  # the video stage's, asked once
        self._own: Any = None  # this replica's actor
        self._own_key = ""  # its key (32 hex digits: the job ids name it)
        self._peers: dict[str, Any] = {}  # other replicas' actors, by key

    def reconfigure(self, graph: GraphConfig) -> None:
        """New run-time settings: the actor's now (in order before any later create), or when it starts."""
        self.settings = jobs_graph(graph)
        if self._own is not None:
            self._own.reconfigure.remote(self.settings)

    async def rules(self) -> VideoRules:
        """The video stage's defaults and limits (asked once; a stage that cannot answer fails the request)."""
        if self._rules is None:
            stage = self._video_stage or ""
            try:
                rules = await self.stages[stage].video_rules.remote()
            except Exception as err:
                raise from_failure(StageFailed(stage, err), "video_rules") from None
            if rules is None:
                raise APIError(500, f"stage '{stage}' makes no video", type="server_error", code="not_a_video_stage")
            self._rules = rules
        return self._rules

    async def create(self, job: VideoJob, request: OmniRequest) -> dict[str, Any]:
        """The job created in this replica's actor; an actor found dead is replaced once, then 503 (never a 500)."""
        from ray.exceptions import RayActorError

        for _ in range(2):
            key, jobs = self._own_actor()
            job.id = new_job_id(key)
            try:
                return unpack(await jobs.create.remote(job, request))["job"]
            except RayActorError:
                self._died(jobs)
        raise APIError(
            503,
            "this server's video jobs are unavailable, retry later",
            type="service_unavailable",
            code="video_jobs_unavailable",
            retry_after_s=5,
        )

    async def ask(self, video_id: str, method: str, *args: Any) -> Any:
        """One call of the actor that runs ``video_id``; a dead actor (its replica stopped) is a 404."""
        from ray.exceptions import RayActorError

        jobs = await self._actor_of(video_id)
        try:
            return await getattr(jobs, method).remote(video_id, *args)
        except RayActorError:
            self._peers.pop(actor_key_of(video_id) or "", None)
            self._died(jobs)
            raise not_found(video_id) from None

    async def video(self, video_id: str, owner: str) -> memoryview:
        """The job's MP4, read from the object store by reference (zero-copy from shared memory)."""
        import ray

        [result] = unpack(await self.ask(video_id, "content", owner))["result"]
        video = await result if isinstance(result, ray.ObjectRef) else result
        return memoryview(video).cast("B")

    async def page(self, owner: str, limit: int, descending: bool, after: str | None) -> dict[str, Any]:
        """OpenAI's list of the owner's jobs on every ingress replica of this application: each actor gives the
        positions of its first ``limit`` past ``after``; the page's jobs alone are fetched."""
        cursor = None
        if after is not None:
            with contextlib.suppress(APIError):  # an id that expired, or was never this client's: nothing after it
                cursor = await self.ask(after, "position", owner)
            if cursor is None:
                return video_list([], has_more=False)
        actors = await self._actors()
        pages = await asyncio.gather(
            *(actor.page.remote(owner, limit + 1, descending, cursor) for actor in actors.values()),
            return_exceptions=True,
        )
        found = sorted(
            (tuple(position) for page in pages if isinstance(page, list) for position in page), reverse=descending
        )
        shown = [video_id for _, video_id in found[:limit]]
        by_actor: dict[str, list[str]] = {}
        for video_id in shown:
            by_actor.setdefault(actor_key_of(video_id) or "", []).append(video_id)
        fetched: dict[str, dict[str, Any]] = {}
        for key, ids in by_actor.items():
            with contextlib.suppress(Exception):  # an actor that stopped meanwhile: its jobs are gone
                fetched.update((job["id"], job) for job in await actors[key].listed.remote(ids, owner))
        return video_list([fetched[i] for i in shown if i in fetched], has_more=len(found) > limit)

    def _own_actor(self) -> tuple[str, Any]:
        """(key, handle) of this replica's actor, started now if there is none.

        No CPU, on this node, owned by this replica's process (it dies with the replica, and with it the
        replica's jobs: the module docstring says what that means), named after this Serve application and a
        key of its own, which every job id carries.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._own is None:
            context = ray.get_runtime_context()
            self._own_key = uuid.uuid4().hex
            self._own = (
                ray.remote(VideoJobs)
                .options(
                    name=actor_name(self.app, self._own_key),
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False),
                    max_concurrency=1000,
                )
                .remote(self.settings, self.stages)
            )
        return self._own_key, self._own

    def _died(self, handle: Any) -> None:
        """This replica's actor ``handle`` no longer answers: the next create starts another (its jobs are lost:
        404 from every replica, their ids naming an actor that no longer exists)."""
        import ray

        if handle is self._own:
            logger.warning("video jobs actor %s stopped answering: starting another", self._own_key)
            self._own = None
            with contextlib.suppress(Exception):  # unavailable, not dead: its name must not answer for lost jobs
                ray.kill(handle)

    async def _actor_of(self, video_id: str) -> Any:
        """The actor that runs ``video_id``: this replica's, or another's found by name; 404 if none."""
        import ray

        key = actor_key_of(video_id)
        if key is None:
            raise not_found(video_id)
        if self._own is not None and key == self._own_key:
            return self._own
        if key not in self._peers:
            try:
                self._peers[key] = await asyncio.to_thread(ray.get_actor, actor_name(self.app, key))
            except ValueError:  # no such actor: its replica stopped (or never existed)
                raise not_found(video_id) from None
        return self._peers[key]

    async def _actors(self) -> dict[str, Any]:
        """Every jobs actor of this Serve application, by key (this replica's included)."""
        import ray

        names = await asyncio.to_thread(ray.util.list_named_actors)
        actors: dict[str, Any] = {}
        for key in (k for k in (actor_key_in(name, self.app) for name in names) if k is not None):
            if self._own is not None and key == self._own_key:
                actors[key] = self._own
            elif key not in self._peers:
                with contextlib.suppress(ValueError):  # stopped meanwhile
                    self._peers[key] = await asyncio.to_thread(ray.get_actor, actor_name(self.app, key))
            if key in self._peers:
                actors[key] = self._peers[key]
        for gone in set(self._peers) - set(actors):  # their names went with them
            del self._peers[gone]
        return actors
