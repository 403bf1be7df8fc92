"""A request held open on a raw socket, and the stages' in-flight stats that show it cancelled."""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlparse


def stats(graph: Any) -> dict[str, dict[str, Any]]:
    return {s: graph.handle(s).stats.remote().result() for s in STAGES}


def open_request(base_url: str, stream: bool, body: dict[str, Any] | None = None) -> socket.socket:
    """Send the request (``BODY`` unless given) on a raw socket, so the test decides when the client goes away."""
    url = urlparse(base_url)
    body = json.dumps({**(body or BODY), "stream": stream}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def idle(graph: Any) -> bool:
    return all(s["running"] == 0 and s["waiting"] == 0 for s in stats(graph).values())


STAGES = ("thinker", "talker", "code2wav")


TALKER_FRAMES = 4000
BODY = {
    "model": "tiny-qwen3-omni",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "modalities": ["text", "audio"],
    "max_tokens": 8,
    "seed": 7,
    "stage_sampling": {"talker": {"temperature": 0.0, "max_tokens": TALKER_FRAMES}},
}
