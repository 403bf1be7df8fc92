"""``session.updated`` echoes have a budget of their own: what a client already has is not resent at line rate.

An echo carries the whole stored session, so 41-byte empty updates after one large one made the server resend
the tools at the session's whole ``bytes_per_second`` (8 MiB/s): the hostile soak's realtime client kept the
ingress, the proxy and HAProxy busy moving ~8.5 MB/s back to it, CPU every other client's request shares. The
echoes are now also paid from a bucket of ``max_session_config_bytes`` a second (bursts of twice that).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import omni_serve.api.realtime.session as session_module
from omni_serve.api.realtime.budget import TokenBucket
from omni_serve.api.realtime.session import Session
from omni_serve.graph.config import RealtimeConfig
from tests.realtime_session import graph as graph
from tests.realtime_session import recorder as recorder
from tests.realtime_session import replying

EMPTY_UPDATE = json.dumps({"type": "session.update", "session": {}})  # 41 bytes
# The byte and event budgets out of the way: only the echoes' own bounds them.
LIMITS = RealtimeConfig(bytes_per_second=1e12, max_session_bytes=1 << 30, events_per_second=1e6)
CONFIG = LIMITS.max_session_config_bytes


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sessions' budgets on a clock the test moves (``clock[0]``, seconds)."""
    now = [0.0]
    monkeypatch.setattr(session_module, "TokenBucket", lambda rate, cap: TokenBucket(rate, cap, lambda: now[0]))
    return now


def update_with_tools(nbytes: int) -> str:
    tools = [{"type": "function", "name": f"f{i}", "description": "d" * (nbytes // 100)} for i in range(100)]
    return json.dumps({"type": "session.update", "session": {"tools": tools}})


def answers(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] if e["type"] != "error" else e["error"]["code"] for e in events]


def test_empty_updates_are_echoed_at_most_one_largest_settings_a_second(clock: list[float]) -> None:
    async def run() -> list[dict[str, Any]]:
        events, send = recorder()
        session = Session(graph(replying, LIMITS), send)
        await session.handle(update_with_tools(200_000))
        for i in range(200):  # 100 events a second for 2 s
            clock[0] = i / 100
            await session.handle(EMPTY_UPDATE)
        return events

    events = asyncio.run(run())
    echoed = sum(len(json.dumps(e)) for e in events if e["type"] == "session.updated")
    # Before: all 201 answered with the whole session (~40 MB; bytes_per_second allowed it).
    assert echoed <= 2 * CONFIG + 2 * CONFIG, echoed  # the burst, and 2 s at max_session_config_bytes a second
    kinds = answers(events)
    assert len(kinds) == 201 and set(kinds) == {"session.updated", "rate_limit_exceeded"}, set(kinds)
    assert kinds.count("session.updated") >= 4  # the burst's two, then one a second at least
    refused = next(e["error"] for e in events if e["type"] == "error")
    assert "realtime.max_session_config_bytes" in refused["message"]


def test_a_refused_update_is_not_applied_and_one_after_the_refill_is(clock: list[float]) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[str | None]]:
        events, send = recorder()
        session = Session(graph(replying, LIMITS), send)
        instructions = []
        for _ in range(2):  # the burst: two largest settings
            await session.handle(update_with_tools(240_000))
        for when in (0.0, 1.0):
            clock[0] = when
            await session.handle(json.dumps({"type": "session.update", "session": {"instructions": "be brief"}}))
            instructions.append(session.settings.instructions)
        return events, instructions

    events, instructions = asyncio.run(run())
    assert answers(events) == ["session.updated"] * 2 + ["rate_limit_exceeded", "session.updated"]
    assert instructions[0] != "be brief" and instructions[1] == "be brief", instructions
