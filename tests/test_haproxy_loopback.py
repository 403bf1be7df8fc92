"""omni_serve/cli/haproxy_loopback.sh over the config Ray Serve 2.60 itself writes: its stats page and Prometheus
endpoint bound to 127.0.0.1, its admin socket its owner's only, each client's own address in X-Forwarded-For (and
the replica's server, as Serve configures uvicorn, taking it), and the result a config HAProxy accepts.

(The live check, `make serve`'s HAProxy listening on loopback only: tests/test_front_door.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from omni_serve.cli.run import HAPROXY_LOOPBACK, haproxy_environment, real_haproxy_binary

STATS, METRICS = 22993, 22994


def serve_config(tmp_path: Path, frontend: int | None = None, replica: int | None = None) -> Path:
    """The HAProxy config Serve's proxy writes (its own template and renderer), for a loopback HTTP frontend (on
    port ``frontend``, else Serve's default) routing to one ingress replica's server on this node (``replica``)."""
    ports = {"RAY_SERVE_HAPROXY_STATS_PORT": str(STATS), "RAY_SERVE_HAPROXY_METRICS_PORT": str(METRICS)}
    script = (
        "import sys\n"
        "from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig\n"
        "from ray.serve.config import HTTPOptions\n"
        "d, frontend, replica = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
        "http = HTTPOptions(host='127.0.0.1', **({'port': frontend} if frontend else {}))\n"
        "cfg = HAProxyConfig(socket_path=d + '/admin.sock', server_state_base=d, server_state_file=d + '/state',"
        " metrics_socket_path=d + '/metrics.sock', http_options=http)\n"
        "servers = [ServerConfig(name='replica', host='127.0.0.1', port=replica)] if replica else []\n"
        "backends = {'app': BackendConfig(name='app', path_prefix='/', app_name='app', servers=servers)}\n"
        "HAProxyApi(cfg=cfg, backend_configs=backends, config_file_path=d + '/haproxy.cfg')"
        "._generate_config_file_internal()\n"
    )
    # A process of its own, with these ports (Serve reads them when it is imported); this process's environment,
    # the session cluster's HAProxy ports among it, is left as it is.
    argv = [sys.executable, "-c", script, str(tmp_path), str(frontend or 0), str(replica or 0)]
    subprocess.run(argv, check=True, timeout=120, env={**os.environ, **ports})
    return tmp_path / "haproxy.cfg"


@pytest.fixture(scope="module")
def serves(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Serve's config for Serve's default frontend, rendered once for the module (a process importing Serve)."""
    return serve_config(tmp_path_factory.mktemp("serve")).read_text()


@pytest.fixture
def config(tmp_path: Path, serves: str) -> Path:
    """A copy of :func:`serves` of this test's own, to change or rewrite."""
    path = tmp_path / "haproxy.cfg"
    path.write_text(serves)
    return path


def wrapped(tmp_path: Path, real: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMNI_SERVE_HAPROXY_BINARY": real,
        "RAY_SERVE_HAPROXY_STATS_PORT": str(STATS),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(METRICS),
    }
    return subprocess.run([str(HAPROXY_LOOPBACK), *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_wrapper_keeps_serves_stats_and_admin_socket_to_this_machine(tmp_path: Path, config: Path) -> None:
    original = config.read_text()
    assert f"bind *:{STATS}" in original and f"bind :{METRICS}" in original and " mode 666 level admin" in original
    # A stand-in binary that prints the arguments and the config it was given.
    echo = tmp_path / "echo-haproxy"
    echo.write_text('#!/bin/sh\necho "$@"\nwhile [ "$1" != "-f" ]; do shift; done\ncat "$2"\n')
    echo.chmod(0o755)
    result = wrapped(tmp_path, str(echo), "-db", "-f", str(config), "-sf", "123")
    assert result.returncode == 0, result.stderr
    argv, _, seen = result.stdout.partition("\n")
    assert argv == f"-db -f {config}.loopback -sf 123"
    assert f"bind 127.0.0.1:{STATS}" in seen and f"bind 127.0.0.1:{METRICS}" in seen
    assert f"*:{STATS}" not in seen and f"bind :{METRICS}" not in seen
    assert " mode 600 level admin" in seen and "mode 666" not in seen
    assert "frontend http_frontend\n    http-request set-header X-Forwarded-For %[src]\n" in seen
    assert seen.count("X-Forwarded-For") == 1  # the HTTP frontend's only (not the gRPC one, not Prometheus')
    assert config.read_text() == original  # Serve's own file is left as Serve wrote it


def test_haproxy_accepts_the_rewritten_config(tmp_path: Path, config: Path) -> None:
    result = wrapped(tmp_path, real_haproxy_binary(), "-c", "-f", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid" in (result.stdout + result.stderr).lower()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (f"bind *:{STATS}", "the stats line"),
        (f"bind :{METRICS}", "the metrics line"),
        (" mode 666 level admin", "the admin socket line"),
        ("frontend http_frontend", "the section 'frontend http_frontend'"),
    ],
)
def test_a_config_without_a_line_to_rewrite_fails_the_start(
    tmp_path: Path, config: Path, line: str, named: str
) -> None:
    """Serve's config with one of the four lines gone (a changed template): HAProxy is not started at all."""
    kept = [kept for kept in config.read_text().splitlines() if line not in kept]
    config.write_text("\n".join(kept) + "\n")
    started = tmp_path / "started"
    result = wrapped(tmp_path, "/bin/touch", str(started), "-f", str(config))
    assert result.returncode == 1 and named in result.stderr and "not starting HAProxy" in result.stderr
    assert not started.exists()


REPLICA_APP = """
async def app(scope, receive, send):  # a websocket is told the client its server saw, and the header it got
    await receive()
    if scope["type"] == "http":  # HAProxy's health check
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    forwarded = [value.decode() for name, value in scope["headers"] if name == b"x-forwarded-for"]
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps([scope["client"][0], forwarded])})
    await send({"type": "websocket.close"})
"""


def replica_server(port: int) -> str:
    """An ingress replica's HTTP server as Serve 2.60's ``start_asgi_http_server`` configures uvicorn: what it
    passes, and uvicorn's defaults for the rest (proxy headers on, trusted from FORWARDED_ALLOW_IPS or loopback)."""
    return (
        "import asyncio, json, uvicorn\n"
        f"{REPLICA_APP}\n"
        f"config = uvicorn.Config(lambda: app, factory=True, host='127.0.0.1', port={port}, lifespan='off',"
        " access_log=False, log_level=None, log_config=None)\n"
        "asyncio.run(uvicorn.Server(config).serve())\n"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_leaves_uvicorns_proxy_headers_at_their_defaults() -> None:
    """What :func:`replica_server` plays, read from Serve: a change here would change who a client is."""
    from ray.serve._private.http_util import start_asgi_http_server

    source = inspect.getsource(start_asgi_http_server)
    assert "uvicorn.Config(" in source
    assert "proxy_headers" not in source and "forwarded_allow_ips" not in source


def test_behind_the_wrapped_haproxy_a_replica_sees_each_clients_own_address(tmp_path: Path) -> None:
    """Websockets from 127.0.0.2 and 127.0.0.3 reach the replica's server as those two clients (Serve's own
    config: both as 127.0.0.1, HAProxy), and an X-Forwarded-For the client sent names nobody, from an address
    uvicorn trusts (127.0.0.1) or not (behind an appending `option forwardfor` the first one would)."""
    import websockets

    frontend, replica = free_port(), free_port()
    config = serve_config(tmp_path, frontend, replica)
    server_env = {k: v for k, v in os.environ.items() if k != "FORWARDED_ALLOW_IPS"}  # uvicorn's default trust
    server = subprocess.Popen([sys.executable, "-c", replica_server(replica)], env=server_env)
    env = {
        **os.environ,
        "OMNI_SERVE_HAPROXY_BINARY": real_haproxy_binary(),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(STATS),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(METRICS),
    }
    haproxy = subprocess.Popen([str(HAPROXY_LOOPBACK), "-db", "-f", str(config)], env=env, stdout=subprocess.DEVNULL)

    async def seen(source: str, forged: str | None = None) -> list[Any]:
        headers = {"X-Forwarded-For": forged} if forged else {}
        deadline = time.monotonic() + 60
        while True:  # until HAProxy listens and has seen the replica's server up
            with contextlib.suppress(OSError, websockets.InvalidHandshake):
                url = f"ws://127.0.0.1:{frontend}/"
                async with websockets.connect(url, local_addr=(source, 0), additional_headers=headers) as ws:
                    return list(json.loads(await ws.recv()))
            assert time.monotonic() < deadline and haproxy.poll() is None and server.poll() is None
            await asyncio.sleep(0.2)

    async def clients() -> list[list[Any]]:
        return [
            await seen("127.0.0.2"),
            await seen("127.0.0.3"),
            await seen("127.0.0.1", forged="203.0.113.9"),
            await seen("127.0.0.2", forged="203.0.113.9, 127.0.0.1"),
        ]

    try:
        two, three, forged_trusted, forged = asyncio.run(clients())
    finally:
        for process in (haproxy, server):
            process.terminate()
            process.wait(30)
    assert two == ["127.0.0.2", ["127.0.0.2"]] and three == ["127.0.0.3", ["127.0.0.3"]]
    assert forged_trusted == ["127.0.0.1", ["127.0.0.1"]] and forged == ["127.0.0.2", ["127.0.0.2"]]


def test_a_config_with_none_of_the_lines_fails_the_start(tmp_path: Path) -> None:
    config = tmp_path / "haproxy.cfg"
    config.write_text("global\n    maxconn 10\n")
    result = wrapped(tmp_path, "/bin/true", "-db", "-f", str(config))
    assert result.returncode == 1 and "stats line" in result.stderr


@pytest.mark.parametrize("given", [None, "/usr/sbin/my-haproxy"])
def test_the_real_binary_is_rays_or_the_one_the_operator_named(monkeypatch: pytest.MonkeyPatch, given) -> None:
    if given is None:
        monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
        assert os.access(real_haproxy_binary(), os.X_OK)
    else:
        monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", given)
        assert real_haproxy_binary() == given


def test_the_real_binary_is_never_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process started under a launcher that set the wrapper up (the tests' `make serve`) finds the wrapper in
    RAY_SERVE_HAPROXY_BINARY_PATH: naming it as the real binary made the wrapper run itself until the file name
    was too long, and HAProxy never started."""
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(HAPROXY_LOOPBACK))
    monkeypatch.setenv("OMNI_SERVE_HAPROXY_BINARY", "/usr/sbin/my-haproxy")
    assert real_haproxy_binary() == "/usr/sbin/my-haproxy"
    monkeypatch.delenv("OMNI_SERVE_HAPROXY_BINARY")
    bundled = real_haproxy_binary()
    assert Path(bundled) != HAPROXY_LOOPBACK and os.access(bundled, os.X_OK)
    assert os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(HAPROXY_LOOPBACK)  # left as it was


@pytest.mark.parametrize("given", [None, "7"])
def test_a_new_proxy_has_haproxys_startup_time_to_be_ready(monkeypatch: pytest.MonkeyPatch, given) -> None:
    """Serve kills a proxy that is not ready within its ready check (5 s by default), while HAProxy's manager is
    ready only once HAProxy took its admin socket, which Serve waits up to 30 s for: on a loaded machine the first
    proxy was killed and `make serve` failed. A local cluster's ready check waits longer; an operator's value stays."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    for name in ("RAY_SERVE_HAPROXY_BINARY_PATH", "OMNI_SERVE_HAPROXY_BINARY"):  # haproxy_environment sets them
        monkeypatch.setenv(name, os.environ.get(name, ""))  # and the test restores them
    monkeypatch.delenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", raising=False)
    if given is None:
        monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", given)
    haproxy_environment()
    ready_s = float(os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"])
    assert ready_s == float(given) if given else ready_s > RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S
