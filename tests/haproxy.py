"""Behind Serve's HAProxy ingress: who answered a request (HAProxy's own statistics)."""

from __future__ import annotations

import os
from collections.abc import Callable

HAPROXY_STATS_PORT = int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404"))  # Serve's default


def served_by_ingress_replicas(send: Callable[[], object], times: int = 5, stats_port: int | None = None) -> None:
    """``send`` ``times`` requests and check HAProxy sent each to an ingress replica's own HTTP server.

    Serve keeps a proxy on the head node as HAProxy's ``backup`` server (used only while no
    replica is up); HAProxy's stats (CSV, ``stot``: sessions so far) show who served what.
    """
    import csv

    import httpx

    if stats_port is None:  # the session's cluster: this process started it (tests/conftest.py)
        assert os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", "the session cluster runs Serve's Python proxy"
        stats_port = HAPROXY_STATS_PORT

    def sessions() -> dict[str, dict[str, int]]:
        text = httpx.get(f"http://127.0.0.1:{stats_port}/stats;csv", timeout=10).text.lstrip("# ")
        rows = [r for r in csv.DictReader(text.splitlines()) if r["svname"] not in ("FRONTEND", "BACKEND")]
        kind = {"1": "backup", "0": "primary"}
        by_kind: dict[str, dict[str, int]] = {"backup": {}, "primary": {}}
        for row in rows:
            if row.get("bck") in kind:
                by_kind[kind[row["bck"]]][f"{row['pxname']}/{row['svname']}"] = int(row["stot"] or 0)
        return by_kind

    # Serve calls a graph healthy before HAProxy lists its ingress replicas (HAProxyManager rewrites the config
    # and reloads HAProxy, which zeroes the counters; until then the backup proxy serves): CI saw a count start
    # there (backup 3, no primary) and end after the reload (primary 4 of 5).
    from tests.conftest import wait_until

    wait_until(lambda: sessions()["primary"], 60, lambda: f"HAProxy to list an ingress replica: {sessions()}")
    before = sessions()
    for _ in range(times):
        send()
    after = sessions()
    served = sum(after["primary"].values()) - sum(before["primary"].values())
    assert served >= times, (before, after)
    assert after["backup"] == before["backup"], (before, after)
