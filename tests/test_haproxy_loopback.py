"""omni_serve/cli/haproxy_loopback.sh over the config Ray Serve 2.60 itself writes: its stats page and Prometheus
endpoint bound to 127.0.0.1, its admin socket its owner's only, and the result a config HAProxy accepts.

(The live check, `make serve`'s HAProxy listening on loopback only: tests/test_front_door.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_serve.cli.run import HAPROXY_LOOPBACK, haproxy_environment, real_haproxy_binary

STATS, METRICS = 22993, 22994


def serve_config(tmp_path: Path) -> Path:
    """The HAProxy config Serve's proxy writes (its own template and renderer), for a loopback HTTP frontend."""
    ports = {"RAY_SERVE_HAPROXY_STATS_PORT": str(STATS), "RAY_SERVE_HAPROXY_METRICS_PORT": str(METRICS)}
    script = (
        "import sys\n"
        "from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig\n"
        "d = sys.argv[1]\n"
        "cfg = HAProxyConfig(socket_path=d + '/admin.sock', server_state_base=d, server_state_file=d + '/state',"
        " metrics_socket_path=d + '/metrics.sock')\n"
        "HAProxyApi(cfg=cfg, config_file_path=d + '/haproxy.cfg')._generate_config_file_internal()\n"
    )
    # A process of its own, with these ports (Serve reads them when it is imported); this process's environment,
    # the session cluster's HAProxy ports among it, is left as it is.
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120, env={**os.environ, **ports})
    return tmp_path / "haproxy.cfg"


def wrapped(tmp_path: Path, real: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMNI_SERVE_HAPROXY_BINARY": real,
        "RAY_SERVE_HAPROXY_STATS_PORT": str(STATS),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(METRICS),
    }
    return subprocess.run([str(HAPROXY_LOOPBACK), *args], env=env, capture_output=True, text=True, timeout=60)


def test_the_wrapper_keeps_serves_stats_and_admin_socket_to_this_machine(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
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
    assert config.read_text() == original  # Serve's own file is left as Serve wrote it


def test_haproxy_accepts_the_rewritten_config(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
    result = wrapped(tmp_path, real_haproxy_binary(), "-c", "-f", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid" in (result.stdout + result.stderr).lower()


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (f"bind *:{STATS}", "the stats line"),
        (f"bind :{METRICS}", "the metrics line"),
        (" mode 666 level admin", "the admin socket line"),
    ],
)
def test_a_config_without_a_line_to_rewrite_fails_the_start(tmp_path: Path, line: str, named: str) -> None:
    """Serve's config with one of the three lines gone (a changed template): HAProxy is not started at all."""
    config = serve_config(tmp_path)
    kept = [kept for kept in config.read_text().splitlines() if line not in kept]
    config.write_text("\n".join(kept) + "\n")
    started = tmp_path / "started"
    result = wrapped(tmp_path, "/bin/touch", str(started), "-f", str(config))
    assert result.returncode == 1 and named in result.stderr and "not starting HAProxy" in result.stderr
    assert not started.exists()


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
