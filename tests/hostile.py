"""Probes for the hostile-client suites: what a client that misbehaves left behind, and whether others noticed.

A hostile-client test abuses a deployed graph, then asks:

- **did anyone else notice?** :class:`Victim`: a seeded request whose reply (text and audio bytes) is taken
  alone first, then again while (or after) the abuse runs on the same ingress replica: it must be
  byte-identical;
- **what did it cost, and is it given back?** :class:`Census`: the ingress replica's RSS
  (:func:`ingress_rss`), the bytes in the object stores and the objects that stayed
  (:func:`request_objects`, built on :mod:`tests.object_store`), the ``/dev/shm`` segments of
  omni_serve's engine requests (:func:`shm_segments`), and the streamed-handoff channels and
  flow-control windows still open in the ingress's channels actors (:func:`open_channels`);
- **did it end cleanly?** :func:`idle`: no stage call in flight, no engine request running or waiting.

:class:`RawClient` is a client the test steers byte by byte: it sends one request on a raw socket with a
small receive buffer, reads SSE events only when told, and leaves whenever the test says.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import h11
import httpx

from tests.object_store import object_store_bytes

STAGES = ("thinker", "talker", "code2wav")
# Objects of this size or more are counted by the census: every audio chunk and handoff payload of the
# tiny graph, none of Ray's small bookkeeping objects.
CENSUS_MIN_BYTES = 1024
# An engine request id as omni_serve mints it: the server's request id (a uuid's 32 hex digits), then
# the stage path (':' where the orchestrator writes '/'); shared-memory segments named after one are ours.
ENGINE_REQUEST = re.compile(r"[0-9a-f]{32}:")


# ---- a seeded victim ------------------------------------------------------------------------------


def reply_bytes(base_url: str, body: dict[str, Any], timeout_s: float = 300) -> tuple[str, bytes]:
    """The reply's text and its audio bytes (streamed: every audio delta's, concatenated), as the client got them."""
    if not body.get("stream"):
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        audio = message.get("audio")
        return message.get("content") or "", base64.b64decode(audio["data"]) if audio else b""
    text, audio = [], []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice.get("delta", {})
                text.append(delta.get("content") or "")
                if delta.get("audio", {}).get("data"):
                    audio.append(base64.b64decode(delta["audio"]["data"]))
    return "".join(text), b"".join(audio)


@dataclass
class Victim:
    """A seeded request (``body`` must carry a ``seed`` for every sampling stage) and its reply taken alone."""

    base_url: str
    body: dict[str, Any]
    solo: tuple[str, bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.solo = reply_bytes(self.base_url, self.body)
        assert self.solo[0], "the victim's solo reply has no text: nothing to compare"

    def unharmed(self) -> None:
        """Ask again: the reply must be the solo one, byte for byte."""
        again = reply_bytes(self.base_url, self.body)
        assert again[0] == self.solo[0], "the victim's text differs from its solo reply"
        assert again[1] == self.solo[1], f"the victim's audio differs ({len(again[1])} vs {len(self.solo[1])} bytes)"


# ---- what a request left behind -------------------------------------------------------------------


def ingress_pid(app: str = "omni") -> int:
    """The process id of the application's one ingress replica."""
    from ray._private import state  # the GCS's actor table (the state API needs the dashboard, which tests skip)

    alive = state.actors(actor_state_name="ALIVE").values()
    pids = [a["Pid"] for a in alive if a["ActorClassName"] == f"ServeReplica:{app}:ingress"]
    assert len(pids) == 1, f"expected one ingress replica, found {len(pids)}"
    return int(pids[0])


def ingress_rss(pid: int) -> int:
    """The ingress replica's resident memory, bytes."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def shm_segments() -> dict[str, int]:
    """``/dev/shm`` entries named after an omni_serve engine request (vLLM-Omni's connector chunks and markers)."""
    found = {}
    for name in os.listdir("/dev/shm"):
        if ENGINE_REQUEST.search(name):
            try:
                found[name] = os.stat(os.path.join("/dev/shm", name)).st_size
            except FileNotFoundError:  # unlinked while we looked
                continue
    return found


def channel_actors() -> list[Any]:
    import ray

    from omni_serve.graph.transport import CHANNELS_ACTOR_PREFIX

    named = ray.util.list_named_actors(all_namespaces=True)
    return [
        ray.get_actor(a["name"], namespace=a["namespace"]) for a in named if a["name"].startswith(CHANNELS_ACTOR_PREFIX)
    ]


def open_channels() -> tuple[int, int]:
    """(streamed-handoff channels, flow-control windows) still open in the ingress replicas' channels actors."""
    import ray

    counts = [(ray.get(a.open_channels.remote()), ray.get(a.open_windows.remote())) for a in channel_actors()]
    return sum(c for c, _ in counts), sum(w for _, w in counts)


# Serve's own actors: their bookkeeping objects (long-poll snapshots of ~2 KB) come and go on their own.
SERVE_ACTORS = ("ServeController", "ProxyActor")


@dataclass(frozen=True)
class Held:
    """One object of the census: its size, and who holds it how (``ray memory``'s columns)."""

    size: int
    holder: str  # the holding actor's class, or "driver"/"worker"
    how: str  # local refs, refs from submitted tasks, pinned, the task that makes it


def request_objects(gcs_address: str, min_bytes: int = CENSUS_MIN_BYTES) -> dict[str, Held]:
    """Object id -> :class:`Held` for every object of ``min_bytes`` or more a process of the cluster refers to,
    Serve's controller and proxies left out (``ray memory``'s table, as ``tests/object_store.py`` reads it)."""
    from ray._private import state
    from ray._private.internal_api import node_stats

    from tests.object_store import _cluster_state

    classes = {actor_id: a["ActorClassName"] for actor_id, a in state.actors(actor_state_name="ALIVE").items()}
    found: dict[str, Held] = {}
    for node in _cluster_state(gcs_address).node_table():
        if not node["Alive"]:
            continue
        for worker in node_stats(node["NodeManagerAddress"], node["NodeManagerPort"]).core_workers_stats:
            holder = classes.get(worker.actor_id.hex(), "driver" if worker.worker_type == 1 else "worker")
            if holder in SERVE_ACTORS:
                continue
            for ref in worker.object_refs:
                # A record nothing in its process refers to (no local or task reference, not pinned, in
                # no object) holds nothing: a borrower's bookkeeping left for its owner's next poll. CI saw
                # one stay over 30 s in the channels actor (local=0 submitted=0, a chunk it had been
                # passed as a write's argument) while the owner, the ingress, had freed the object.
                holds = ref.local_ref_count or ref.submitted_task_ref_count or ref.pinned_in_memory
                if ref.object_size >= min_bytes and (holds or ref.contained_in_owned):
                    how = (
                        f"local={ref.local_ref_count} submitted={ref.submitted_task_ref_count} "
                        f"pinned={ref.pinned_in_memory} task={ref.task_status} {ref.call_site[:60]}"
                    )
                    found[ref.object_id.hex()] = Held(int(ref.object_size), holder, how)
    return found


def stage_stats(graphs: Any) -> dict[str, dict[str, Any]]:
    return {s: graphs.handle(s).stats.remote().result() for s in STAGES}


def idle(graphs: Any) -> bool:
    """No stage call in flight in any stage replica, and no engine request running or waiting."""
    return all(
        s["in_flight"] == 0 and s.get("running", 0) == 0 and s.get("waiting", 0) == 0
        for s in stage_stats(graphs).values()
    )


@dataclass
class Census:
    """What the cluster holds before some abuse; :meth:`left` is what is still there after it."""

    gcs_address: str
    pid: int = field(default_factory=ingress_pid)
    rss: int = field(init=False)
    store_bytes: int = field(init=False)
    objects: dict[str, Held] = field(init=False)
    shm: dict[str, int] = field(init=False)
    channels: tuple[int, int] = field(init=False)  # (channels, windows) open before: another request's

    def __post_init__(self) -> None:
        self.rss = ingress_rss(self.pid)
        self.store_bytes = object_store_bytes(self.gcs_address)
        self.objects = request_objects(self.gcs_address)
        self.shm = shm_segments()
        self.channels = open_channels()

    def left(self) -> dict[str, Any]:
        """What the abuse left: objects and segments that were not there before, the stores' and RSS growth."""
        new = {oid: held for oid, held in request_objects(self.gcs_address).items() if oid not in self.objects}
        return {
            "objects_bytes": sum(held.size for held in new.values()),
            "objects": sorted(new.values(), key=lambda held: -held.size)[:8],
            "store_growth": object_store_bytes(self.gcs_address) - self.store_bytes,
            "shm": sorted(set(shm_segments()) - set(self.shm)),
            "rss_growth": ingress_rss(self.pid) - self.rss,
            # Those this request opened and left: one an earlier module left open (seen once in a full run, a
            # flow window: docs/testing.md) is not this request's, as an object that was there before is not.
            "channels_and_windows": tuple(max(n - b, 0) for n, b in zip(open_channels(), self.channels, strict=True)),
            "channels_and_windows_before": self.channels,
        }


# ---- a client the test steers ---------------------------------------------------------------------


class RawClient:
    """One chat request on a raw socket whose receive buffer is small (4 KiB asked), so a client that stops
    reading is felt at once; SSE events are read only when the test asks."""

    def __init__(self, base_url: str, body: dict[str, Any], receive_buffer: int = 4096):
        url = urlparse(base_url)
        data = json.dumps(body).encode()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect: the window
        self.sock.settimeout(300)
        self.sock.connect((url.hostname, url.port))
        # h11 (httpx's HTTP/1.1 parser) frames the exchange: a chunked body's chunks need not end on an event
        # (behind HAProxy they split events), so events are parsed from the de-chunked body only.
        self.http = h11.Connection(h11.CLIENT)
        headers = [("Host", url.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        request = h11.Request(method="POST", target="/v1/chat/completions", headers=[*headers, ("Connection", "close")])
        for part in (request, h11.Data(data=data), h11.EndOfMessage()):
            self.sock.sendall(self.http.send(part) or b"")
        self._pending = b""
        self._ended = False
        self.status: int | None = None

    def _receive(self) -> None:
        """At least one more piece of the response: its status, body bytes or its end."""
        while True:
            event = self.http.next_event()
            if event is h11.NEED_DATA:
                self.http.receive_data(self.sock.recv(65536))  # b"": the connection closed (h11 says if early)
            elif isinstance(event, h11.Response):
                self.status = event.status_code
                assert self.status == 200, event
            elif isinstance(event, h11.Data):
                self._pending += event.data
                return
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                self._ended = True
                return

    def events(self) -> Iterator[dict[str, Any]]:
        """The reply's SSE events as they come (the status checked first); ends with the body."""
        while True:
            while b"\n\n" not in self._pending:
                if self._ended:
                    return
                self._receive()
            event, self._pending = self._pending.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: {"):
                    yield json.loads(line[6:])

    def read_until(self, seen: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read events until one for which ``seen`` is true; that event."""
        for event in self.events():
            if seen(event):
                return event
        raise AssertionError("the reply ended before the awaited event")

    def read_all(self) -> list[dict[str, Any]]:
        return list(self.events())

    def close(self) -> None:
        self.sock.close()


def text_delta(event: dict[str, Any]) -> bool:
    return any(c.get("delta", {}).get("content") for c in event.get("choices", []))


def audio_delta(event: dict[str, Any]) -> bool:
    return any(c.get("delta", {}).get("audio", {}).get("data") for c in event.get("choices", []))


def wait_steady(read: Callable[[], Any], quiet_s: float, timeout_s: float, what: str) -> Any:
    """``read()`` once it returned the same value twice ``quiet_s`` apart (a hang guard, never a measurement)."""
    deadline, last = time.monotonic() + timeout_s, read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read()
        if now == last:
            return now
        last = now
    raise AssertionError(f"{what} still changing after {timeout_s} s (last {last!r})")


# ---- the soak: every abuser at once beside seeded victims -----------------------------------------
# tests/test_hostile_soak.py runs it on the tiny graph and asserts on what it found; benchmarks/hostile_soak.py
# runs it longer, times the victims and prints the figures (a latency is never a test's assertion).

EVIL_ORIGIN = "http://evil.example"
# Every POST route that does work: a foreign Origin is refused on each with 403 before anything runs, whatever
# the body's type (the four a page can send: three without a CORS preflight, and JSON).
CROSS_SITE_ROUTES = (
    "/v1/audio/transcriptions",
    "/v1/chat/completions",
    "/v1/audio/speech",
    "/v1/images/edits",
    "/v1/videos",
)
FORM_KINDS = ("multipart/form-data", "application/x-www-form-urlencoded", "text/plain", "application/json")
# The closes a realtime session may get beside its client's own (docs/realtime.md, Limits): its
# max_session_minutes or a client that does not read (1008), too many sessions (1013). Any other is a failure.
DOCUMENTED_CLOSES = (1000, 1008, 1013)
# Events slipped into the realtime flood, one in ten: each is answered with an error event, the session goes on.
ODD_EVENTS = (
    '{"type": []}',
    '{"type": 7}',
    '{"type": {"session.update": true}}',
    '{"type": null}',
    '{"type": "session.update", "session": []}',
    '{"type": "session.update", "session": {"tools": {}}}',
    '[{"type": "session.update", "session": {}}]',
    "42",
    '"session.update"',
    "null",
)
EMPTY_UPDATE = '{"type": "session.update", "session": {}}'  # 41 bytes: the echo-amplification probe
ANSWER_OVERHEAD = 4096  # bytes an answer to an empty update may take besides the byte budget (an error, the settings)
CALL_TIMEOUT_S = 180  # every client call of the soak is bounded: one that passes it is a hang, never a wait
DRAIN_S = 30  # the realtime flood's answers still due once it stops sending


def model_card(base_url: str) -> dict[str, Any]:
    """``/v1/models``' one card: the model's name, its stages and the routes the graph answers."""
    response = httpx.get(f"{base_url}/v1/models", timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json()["data"][0])


def replica_pids(app: str = "omni") -> dict[str, int]:
    """``deployment#pid`` -> pid for every replica of the application, the ingress's and the stages'."""
    from ray._private import state

    prefix = f"ServeReplica:{app}:"
    alive = state.actors(actor_state_name="ALIVE").values()
    return {
        f"{a['ActorClassName'][len(prefix) :]}#{a['Pid']}": int(a["Pid"])
        for a in alive
        if a["ActorClassName"].startswith(prefix)
    }


def trim_replicas(app: str = "omni") -> None:
    """Every replica process of the application runs its garbage collector and hands the C allocator's free pages
    back to the OS (glibc's ``malloc_trim``), so that its RSS counts what it holds, not what its allocator kept
    for reuse: freed buffers of a busy phase stay resident otherwise (one CI run: the ingress +74 MiB after a
    soak, where a quiet machine read +22 MiB after 270 s of abuse, one abuser at a time), while bytes a replica
    still refers to (a cache, a session's bytes kept) cannot be trimmed and still count. A stage's engine
    process is its child: not trimmed.
    """
    import ray
    from ray._private import state

    def trim(_replica: Any) -> None:  # nested: cloudpickle ships it by value (a replica cannot import tests/)
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    prefix = f"ServeReplica:{app}:"
    alive = [a for a in state.actors(actor_state_name="ALIVE").values() if a["ActorClassName"].startswith(prefix)]
    ray.get([ray.get_actor(a["Name"], namespace="serve").__ray_call__.remote(trim) for a in alive], timeout=60)


def replica_rss(pids: dict[str, int]) -> dict[str, int]:
    """Each replica's resident memory with its children's (a stage's engine process), bytes; gone ones left out."""
    import psutil

    found = {}
    for label, pid in pids.items():
        try:
            process = psutil.Process(pid)
            found[label] = sum(int(p.memory_info().rss) for p in (process, *process.children(recursive=True)))
        except psutil.NoSuchProcess:
            continue
    return found


def grown(before: dict[str, int], after: dict[str, int], tolerance: int) -> dict[str, int]:
    """The replicas whose memory grew by more than ``tolerance`` bytes (label -> growth)."""
    return {label: after[label] - rss for label, rss in before.items() if after.get(label, rss) - rss > tolerance}


def stage_calls(stages: list[str], app: str = "omni") -> dict[str, int]:
    """Stage calls every stage's replica has served (one replica a stage: its handle sees all of them)."""
    from ray import serve

    return {s: int(serve.get_deployment_handle(s, app_name=app).stats.remote().result()["calls"]) for s in stages}


def stages_idle(stages: list[str], app: str = "omni") -> bool:
    from ray import serve

    stats = [serve.get_deployment_handle(s, app_name=app).stats.remote().result() for s in stages]
    return all(s["in_flight"] == 0 and s.get("running", 0) == 0 and s.get("waiting", 0) == 0 for s in stats)


def speech_bytes(base_url: str, body: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> bytes:
    response = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=timeout_s)
    assert response.status_code == 200, response.text
    return response.content


@dataclass
class Seeded:
    """A seeded victim the soak asks again and again: its first reply, each later one compared with it byte for
    byte, and how long each took (quiet: before the abuse; soak: during it)."""

    name: str
    ask: Callable[[], tuple[str, bytes]]
    solo: tuple[str, bytes] | None = None
    seconds: dict[str, list[float]] = field(default_factory=lambda: {"quiet": [], "soak": [], "after": []})
    differed: list[str] = field(default_factory=list)  # "phase #n: what differed"

    def take(self, phase: str) -> None:
        """Ask once and compare; a reply that failed under abuse counts as one that differs (a timeout is
        raised: the caller records the hang)."""
        started = time.perf_counter()
        reply: tuple[str, bytes] | str
        try:
            reply = self.ask()
        except (AssertionError, httpx.TransportError) as err:
            if isinstance(err, httpx.TimeoutException) or self.solo is None:
                raise
            reply = f"failed: {type(err).__name__}: {err}"[:200]
        self.seconds.setdefault(phase, []).append(time.perf_counter() - started)
        n = len(self.seconds[phase])
        if self.solo is None:
            assert not isinstance(reply, str) and (reply[0] or reply[1]), (
                f"the {self.name} victim's solo reply is empty"
            )
            self.solo = reply
        elif isinstance(reply, str):
            self.differed.append(f"{phase} #{n}: {reply}")
        elif reply != self.solo:
            what = "text" if reply[0] != self.solo[0] else f"audio ({len(reply[1])} vs {len(self.solo[1])} bytes)"
            self.differed.append(f"{phase} #{n}: {what}")


def victims(base_url: str, card: dict[str, Any]) -> list[Seeded]:
    """The graph's seeded victims: a streamed chat reply (text, and audio where the graph speaks) and a speech
    reply, each where the graph answers the route; every stage that samples is seeded."""
    model, routes, stages = card["id"], card["routes"], card["stages"]
    found = []
    if "/v1/chat/completions" in routes:
        chat: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "stream": True,
            "max_tokens": 12,
            "seed": 11,
        }
        if "audio" in card["modalities"]:
            chat.update(modalities=["text", "audio"], audio={"voice": "chelsie", "format": "pcm16"})
        if "talker" in stages:
            chat["stage_sampling"] = {"talker": {"seed": 11, "max_tokens": 32}}
        found.append(Seeded("chat", lambda: reply_bytes(base_url, chat, CALL_TIMEOUT_S)))
    if "/v1/audio/speech" in routes:
        speech = {"model": model, "input": "Hello there.", "voice": "chelsie", "response_format": "pcm", "seed": 11}
        found.append(Seeded("speech", lambda: ("", speech_bytes(base_url, speech))))
    assert found, f"the graph answers neither chat nor speech ({routes}): no victim"
    return found


def cross_site_requests(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(route, body kind, httpx arguments) for every route and kind: what a page on another site posts, each
    request a valid one (a server that does not refuse it runs the model)."""
    import numpy as np
    import soundfile as sf
    from PIL import Image

    wav, png = io.BytesIO(), io.BytesIO()
    sf.write(wav, np.zeros(8000, dtype=np.float32), 16000, format="WAV")
    Image.new("RGB", (64, 64)).save(png, format="PNG")
    fields: dict[str, dict[str, str]] = {
        "/v1/audio/transcriptions": {"model": model},
        "/v1/chat/completions": {"model": model, "messages": json.dumps([{"role": "user", "content": "Hi."}])},
        "/v1/audio/speech": {"model": model, "input": "Hi.", "response_format": "pcm"},
        "/v1/images/edits": {"model": model, "prompt": "a red fox", "size": "64x64"},
        "/v1/videos": {"model": model, "prompt": "a red fox", "size": "64x64", "num_frames": "9"},
    }
    files = {
        "/v1/audio/transcriptions": ("file", wav.getvalue(), "a.wav"),
        "/v1/images/edits": ("image", png.getvalue(), "a.png"),
    }
    found = []
    for route in CROSS_SITE_ROUTES:
        data = fields[route]
        as_json = json.dumps({k: json.loads(v) if k == "messages" else v for k, v in data.items()})
        headers = {"Origin": EVIL_ORIGIN}
        name, content, filename = files.get(route, ("upload", b"", "none"))
        for kind in FORM_KINDS:
            if kind == "multipart/form-data":
                upload = {name: (filename, content)} if route in files else {"_": (None, "")}
                found.append((route, kind, {"data": data, "files": upload, "headers": headers}))
            elif kind == "application/x-www-form-urlencoded":
                found.append((route, kind, {"data": data, "headers": headers}))
            else:
                found.append((route, kind, {"content": as_json, "headers": {**headers, "Content-Type": kind}}))
    return found


def post_cross_site(base_url: str, model: str) -> dict[tuple[str, str], int]:
    """One round of the page's posts, one at a time: (route, kind) -> the status each got."""
    with httpx.Client(base_url=base_url, timeout=CALL_TIMEOUT_S) as client:
        return {(route, kind): client.post(route, **kw).status_code for route, kind, kw in cross_site_requests(model)}


def schema_chat(model: str, i: int) -> dict[str, Any]:
    """A chat request whose ``response_format`` is a schema no request had before: a new grammar to compile."""
    fresh = f"field_{i}_{os.getpid()}_{time.monotonic_ns()}"
    schema = {
        "type": "object",
        "properties": {fresh: {"type": "string", "maxLength": 4 + i % 7}, f"n{i}": {"type": "integer"}},
        "required": [fresh],
    }
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Give me a record."}],
        "max_tokens": 8,
        "seed": i,
        "response_format": {"type": "json_schema", "json_schema": {"name": f"record_{i}", "schema": schema}},
    }


@dataclass
class RealtimeAbuse:
    """What the realtime abuser sent and what came back."""

    largest_update: int = 0  # bytes of the largest session.update the server took (nearly all tools)
    refused_updates: list[str] = field(default_factory=list)  # "bytes: error code" of larger ones it refused
    sessions: int = 0  # sessions opened (one, unless the server closed one)
    sent: int = 0  # flood events: empty updates and odd types
    answered: int = 0  # their answers (session.updated or error)
    answer_bytes: int = 0  # the answers' bytes
    largest_answer: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # error codes of the answers
    closes: list[str] = field(default_factory=list)  # closes that are no documented limit: "code reason"
    flood_s: float = 0.0  # seconds the flood ran, every session together

    def failures(self, limits: Any) -> list[str]:
        """What broke the rules: the echo over the session's byte budget, an undocumented close, an event
        unanswered (``limits``: the graph's ``RealtimeConfig``)."""
        found = [f"closed {n} x: {close}" for close, n in Counter(self.closes).most_common()]
        if not self.largest_update:
            found.append(f"no session.update with tools was taken ({self.refused_updates})")
        # What the sessions' byte budgets let them move: each a burst, then the rate (a bound on every echo).
        burst = limits.max_session_bytes * max(self.sessions, 1)
        budget = limits.bytes_per_second * self.flood_s + burst + ANSWER_OVERHEAD * self.answered
        if self.answer_bytes > budget:
            found.append(
                f"echo amplification: {self.answer_bytes} bytes answered {self.sent} events of under 64 "
                f"bytes each in {self.flood_s:.0f} s (budget {budget:.0f}; largest answer "
                f"{self.largest_answer})"
            )
        if self.answered < self.sent and not self.closes:
            found.append(f"{self.sent - self.answered} of {self.sent} events unanswered after {DRAIN_S} s")
        return found


def _event_type(message: str | bytes) -> str:
    head = message[:256] if isinstance(message, str) else message[:256].decode("utf-8", "replace")
    kind = re.search(r'"type"\s*:\s*"([^"]+)"', head)
    return kind.group(1) if kind else "?"


def _error_code(message: str | bytes) -> str:
    try:
        return str(json.loads(message)["error"].get("code") or "none")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unreadable"


def tools_update(total: int) -> str:
    """A ``session.update`` of about ``total`` bytes, nearly all of it tools (the most functions a session may
    have, each with a long description)."""
    from omni_serve.api.openai.tools import MAX_TOOLS

    each = max(total // MAX_TOOLS - 160, 1)
    tools = [
        {"type": "function", "name": f"tool_{i}", "description": "d" * each, "parameters": {"type": "object"}}
        for i in range(MAX_TOOLS)
    ]
    return json.dumps({"type": "session.update", "session": {"tools": tools}})


async def _answer(ws: Any) -> str | bytes:
    import asyncio

    return await asyncio.wait_for(ws.recv(), CALL_TIMEOUT_S)


async def _largest_update(ws: Any, limits: Any, abuse: RealtimeAbuse) -> None:
    """The largest tools update the server takes: from just under ``max_event_bytes``, halved on each refusal
    (a limit on tools of its own); once found, each new session gets it again."""
    size = abuse.largest_update or limits.max_event_bytes - (64 << 10)
    while size >= 64 << 10:
        event = tools_update(size)
        await ws.send(event)
        while (kind := _event_type(answer := await _answer(ws))) not in ("session.updated", "error"):
            continue
        if kind == "session.updated":
            abuse.largest_update = len(event)
            return
        abuse.refused_updates.append(f"{len(event)}: {_error_code(answer)}")
        size //= 2


async def _flood(ws: Any, limits: Any, until: float, abuse: RealtimeAbuse) -> None:
    """Empty updates at just under the allowed event rate, one odd event in ten, the answers read meanwhile;
    then the answers still due, for at most :data:`DRAIN_S`."""
    import asyncio

    sent = answered = 0
    stopped, caught_up = False, asyncio.Event()

    async def read() -> None:
        nonlocal answered
        while True:
            message = await _answer(ws)
            kind = _event_type(message)
            if kind not in ("session.updated", "error"):
                continue
            answered += 1
            abuse.answer_bytes += len(message)
            abuse.largest_answer = max(abuse.largest_answer, len(message))
            if kind == "error":
                abuse.errors[_error_code(message)] += 1
            if stopped and answered >= sent:
                caught_up.set()

    reader = asyncio.create_task(read())
    started = time.monotonic()
    try:
        period = 1 / (0.95 * limits.events_per_second)
        while (now := time.monotonic()) < until and not reader.done():
            await ws.send(ODD_EVENTS[(sent // 10) % len(ODD_EVENTS)] if sent % 10 == 9 else EMPTY_UPDATE)
            sent += 1
            await asyncio.sleep(max(0.0, started + sent * period - now))
        stopped = True
        if answered < sent:
            waiter = asyncio.create_task(caught_up.wait())
            await asyncio.wait({reader, waiter}, timeout=DRAIN_S, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if reader.done():
            reader.result()  # a close: raised here
    finally:
        reader.cancel()
        if reader.done() and not reader.cancelled():
            reader.exception()  # retrieved: the close is the sender's to raise (or was raised above)
        abuse.sent += sent
        abuse.answered += answered
        abuse.flood_s += time.monotonic() - started


async def realtime_abuse(ws_url: str, limits: Any, until: float) -> RealtimeAbuse:
    """One realtime client at a time, sending the worst events allowed until ``until``: the largest update,
    then the flood; a session the server closes is recorded (unless at a documented limit) and opened again."""
    import asyncio

    import websockets

    abuse = RealtimeAbuse()
    while time.monotonic() < until:
        try:
            async with websockets.connect(ws_url, max_size=None, open_timeout=60, ping_interval=None) as ws:
                while _event_type(await _answer(ws)) != "session.created":
                    continue
                abuse.sessions += 1
                await _largest_update(ws, limits, abuse)
                await _flood(ws, limits, until, abuse)
        except websockets.ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd else None
            if code not in DOCUMENTED_CLOSES:
                abuse.closes.append(f"{code} {closed.rcvd.reason if closed.rcvd else 'no close frame'}"[:160])
        except TimeoutError:
            abuse.closes.append(f"hung: no answer within {CALL_TIMEOUT_S} s")
        except (websockets.InvalidHandshake, OSError) as refused:
            abuse.closes.append(f"refused: {refused}"[:160])
            await asyncio.sleep(1)
    return abuse


RUNNING_JOB = ("queued", "in_progress")


@dataclass
class VideoBurst:
    """A burst of video jobs at once: what each create got, how each job ended, and whether one more may be created
    once they did (a burst that failed must not hold the replica's job slots)."""

    created: Counter[int] = field(default_factory=Counter)
    ended: Counter[str] = field(default_factory=Counter)
    after: int | None = None  # the status of the create after the burst

    def failures(self) -> list[str]:
        found = [f"{n} jobs {s} past the soak" for s, n in self.ended.items() if s in RUNNING_JOB]
        if set(self.created) - {200, 429}:
            found.append(f"creates answered {dict(self.created)}")
        if self.after != 200:
            found.append(f"a create after the burst got {self.after}")
        return found


async def video_burst(base_url: str, model: str, jobs: int, until: float) -> VideoBurst:
    import asyncio

    burst = VideoBurst()
    params = {"model": model, "prompt": "a red fox", "size": "64x64", "num_frames": 9, "num_inference_steps": 2}
    async with httpx.AsyncClient(base_url=base_url, timeout=CALL_TIMEOUT_S) as client:
        answers = await asyncio.gather(*(client.post("/v1/videos", json={**params, "seed": i}) for i in range(jobs)))
        burst.created.update(a.status_code for a in answers)
        ids = [a.json()["id"] for a in answers if a.status_code == 200]
        status: dict[str, str] = dict.fromkeys(ids, "queued")

        def running() -> list[str]:
            return [job for job, s in status.items() if s in RUNNING_JOB]

        while running() and time.monotonic() < until + CALL_TIMEOUT_S:
            await asyncio.sleep(1)
            for job in running():
                status[job] = (await client.get(f"/v1/videos/{job}")).json()["status"]
        burst.ended.update(status.values())
        again = await client.post("/v1/videos", json={**params, "seed": jobs})
        burst.after = again.status_code
        if again.status_code == 200:
            ids.append(again.json()["id"])
        for job in ids:
            await client.delete(f"/v1/videos/{job}")
    return burst


@dataclass
class Soak:
    """Everything the soak found: the victims, and each abuser's record."""

    victims: list[Seeded]
    forms: Counter[tuple[str, str, int]] = field(default_factory=Counter)  # (route, kind, status) -> times
    schemas: Counter[int] = field(default_factory=Counter)  # the new-schema chats' statuses
    realtime: RealtimeAbuse | None = None
    videos: VideoBurst | None = None
    hung: list[str] = field(default_factory=list)  # calls that passed CALL_TIMEOUT_S, or lost their connection

    def failures(self, limits: Any) -> dict[str, list[str]]:
        """Each check (latency aside) -> what failed it (empty: it held)."""
        return {
            "identity": [f"{v.name} {d}" for v in self.victims for d in v.differed],
            "cross_site": [f"{r} {k}: {s} x {n}" for (r, k, s), n in sorted(self.forms.items()) if s != 403],
            "schemas": [f"{s} x {n}" for s, n in sorted(self.schemas.items()) if s != 200],
            "realtime": self.realtime.failures(limits) if self.realtime else [],
            "videos": self.videos.failures() if self.videos else [],
            "hung": list(self.hung),
        }


async def _until(deadline: float, what: str, hung: list[str], step: Callable[[], Any]) -> None:
    """``await step()`` again and again until ``deadline``; a call that timed out is recorded as hung."""
    while time.monotonic() < deadline:
        try:
            await step()
        except httpx.TimeoutException as err:
            hung.append(f"{what}: {type(err).__name__}")
        except httpx.TransportError as err:  # the server dropped the connection: as bad as a hang for a client
            hung.append(f"{what}: {type(err).__name__} {err}"[:160])


# The soak's abusers by name (benchmarks/hostile_soak.py --only runs some of them alone).
ABUSERS = ("realtime", "cross-site", "schemas", "video")


def run_soak(
    base_url: str,
    card: dict[str, Any],
    limits: Any,
    seconds: float,
    targets: list[Seeded],
    video_jobs: int = 8,
    video_url: str | None = None,
    abusers: tuple[str, ...] = ABUSERS,
    phase: str = "soak",
) -> Soak:
    """Every abuser at once (``abusers``: those of :data:`ABUSERS` to run) for ``seconds``, the victims asked
    again and again meanwhile (in a thread of their own, one request at a time, timed under ``phase``): a
    realtime client, a page posting forms cross-site, chats with a new schema each, a burst of video jobs where
    the graph makes video (or on the video graph at ``video_url``)."""
    import asyncio

    assert set(abusers) <= set(ABUSERS), f"no such abuser: {set(abusers) - set(ABUSERS)}"
    soak = Soak(targets)
    model, routes = card["id"], card["routes"]
    until = time.monotonic() + seconds

    def ask_victims() -> None:
        while time.monotonic() < until:
            for victim in targets:
                try:
                    victim.take(phase)
                except httpx.TimeoutException as err:
                    soak.hung.append(f"victim {victim.name}: {type(err).__name__}")

    async def everything() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=CALL_TIMEOUT_S) as client:
            page = cross_site_requests(model)
            posted = 0

            async def post_form() -> None:  # one post every 0.25 s: a page's forms, not a flood
                nonlocal posted
                route, kind, kw = page[posted % len(page)]
                posted += 1
                soak.forms[(route, kind, (await client.post(route, **kw)).status_code)] += 1
                await asyncio.sleep(0.25)

            schema = 0

            async def new_schema() -> None:  # same-origin, as the playground: never refused
                nonlocal schema
                schema += 1
                body = schema_chat(model, schema)
                answer = await client.post("/v1/chat/completions", json=body, headers={"Origin": base_url})
                soak.schemas[answer.status_code] += 1

            jobs: list[Any] = [asyncio.to_thread(ask_victims)]
            if "cross-site" in abusers:
                jobs.append(_until(until, "cross-site form", soak.hung, post_form))
            if "schemas" in abusers and "/v1/chat/completions" in routes:
                jobs.append(_until(until, "new-schema chat", soak.hung, new_schema))
            if "realtime" in abusers and "/v1/realtime" in routes:
                ws_url = f"{base_url.replace('http', 'ws', 1)}/v1/realtime?model={model}"
                jobs.append(realtime_abuse(ws_url, limits, until))
            if "video" in abusers and video_url:
                jobs.append(video_burst(video_url, model_card(video_url)["id"], video_jobs, until))
            elif "video" in abusers and "/v1/videos" in routes:
                jobs.append(video_burst(base_url, model, video_jobs, until))
            results = await asyncio.gather(*jobs)
            for result in results:
                if isinstance(result, RealtimeAbuse):
                    soak.realtime = result
                elif isinstance(result, VideoBurst):
                    soak.videos = result

    asyncio.run(everything())
    return soak


def summary(soak: Soak, phase: str = "soak") -> str:
    """One paragraph of what each client of the soak did and got (timings aside)."""
    parts = [f"{v.name}: {len(v.seconds.get(phase, []))} replies, {len(v.differed)} differed" for v in soak.victims]
    statuses: Counter[int] = Counter()
    for (_, _, status), n in soak.forms.items():
        statuses[status] += n
    parts.append(f"cross-site posts {sum(soak.forms.values())}, statuses {dict(statuses)}")
    parts.append(f"new-schema chats {dict(soak.schemas)}")
    if abuse := soak.realtime:
        parts.append(
            f"realtime: largest update taken {abuse.largest_update} bytes (refused: {abuse.refused_updates}), "
            f"{abuse.sent} flood events in {abuse.flood_s:.0f} s, {abuse.answered} answered in {abuse.answer_bytes} "
            f"bytes (largest {abuse.largest_answer}), errors {dict(abuse.errors)}, closes {dict(Counter(abuse.closes))}"
        )
    if burst := soak.videos:
        parts.append(f"videos: created {dict(burst.created)}, ended {dict(burst.ended)}, one more: {burst.after}")
    parts.append(f"hung {len(soak.hung)}")
    return "; ".join(parts)
