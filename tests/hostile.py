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
import json
import os
import re
import socket
import time
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
