"""The front door: `make serve` installs once, prints one ready line, stays quiet, and stops cleanly on SIGTERM.

`make serve` here runs the real Makefile and launcher (omni_serve.cli.run) on its own local Ray cluster
(the session cluster keeps its graph); the install stamp is pre-made, as `make test` leaves it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import HTTP_PORT, wait_until
from tests.haproxy import served_by_ingress_replicas

REPO = Path(__file__).resolve().parent.parent
SERVE_PORT = HTTP_PORT + 2  # +1 is the session cluster's metrics port
NOISE = [" INFO ", "GET /health", "rope_parameters", "Loading weights", "Cannot deregister", "dashboard", "Token auth"]
BROKEN = ["SIGTERM received", "Aborted", "Traceback", "make: ***", "Error"]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(workdir: Path, stamps: Path) -> str:
    """What `make serve` would run (make -n prints the commands, silent ones included)."""
    cli = ["make", "-n", "-C", str(workdir), "serve", f"PYTHON={sys.executable}", f"STAMPS={stamps}"]
    return subprocess.run(cli, capture_output=True, text=True, check=True).stdout


@needs_make
def test_second_make_serve_starts_without_pip(tmp_path: Path) -> None:
    # What the install stamp depends on (the Makefile's prerequisites of $(STAMPS)/install).
    for name in (
        "Makefile",
        "pyproject.toml",
        ".ci/unchanged.py",
        ".ci/install-torchvision-cpu.sh",
        ".ci/torchvision_cpu.py",
    ):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    stamps = tmp_path / "stamps"
    assert re.search(r"-m pip .*install -e \.", dry_run(tmp_path, stamps))  # a fresh environment installs
    stamps.mkdir()
    (stamps / "install").touch()  # what the first install leaves
    plan = dry_run(tmp_path, stamps)
    assert "pip" not in plan and "-m omni_serve.cli.run graphs/tiny_omni.yaml" in plan
    later = time.time() + 60
    os.utime(tmp_path / "pyproject.toml", (later, later))  # a dependency changed: install again
    assert re.search(r"-m pip .*install -e \.", dry_run(tmp_path, stamps))


@needs_make
@pytest.mark.integration
def test_make_serve_prints_one_ready_line_and_stops_on_sigterm(tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    (stamps / "install").touch()
    # As from a fresh shell: its own Ray cluster, and no outer make's recursion state (`make test` runs this).
    fresh_shell = {"RAY_ADDRESS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}
    env = {k: v for k, v in os.environ.items() if k not in fresh_shell and k != "RAY_SERVE_ENABLE_HA_PROXY"}
    # make serve runs Serve's HAProxy ingress by default: its own ports next to the test's, not Serve's
    # defaults (8404, 9101, 30000+), which another cluster on the machine may hold.
    env |= {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(SERVE_PORT + 1),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(SERVE_PORT + 2),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(SERVE_PORT + 3),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(SERVE_PORT + 6),
    }
    cli = ["make", "serve", f"PYTHON={sys.executable}", f"STAMPS={stamps}", f"PORT={SERVE_PORT}", "ARGS=--no-dashboard"]
    # Its own process group, signalled as a whole below, as timeout(1) or systemd do. Not its own session where
    # Python can make a group without one (3.11): the kernel gives each session's processes their own share of the
    # CPU (autogroup), so a new session would escape the lower priority of the lane this runs in (tests/lanes.py).
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    make = subprocess.Popen(
        cli, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **group
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert make.stdout is not None
        for line in make.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("omni_serve ready"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not ready.wait(1):
            assert make.poll() is None, "make serve exited before it was ready:\n" + "\n".join(lines)
        [line] = [x for x in lines if x.startswith("omni_serve ready")]
        url = f"http://127.0.0.1:{SERVE_PORT}"
        assert f"API {url}/v1 | playground {url}/ | tiny-qwen3-omni: thinker -> talker -> code2wav" in line
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # the line comes after /health is green
        assert httpx.get(f"{url}/", follow_redirects=True, timeout=30).headers["content-type"].startswith("text/html")
        # Serve's HAProxy ingress by default: the ingress replica, not the backup proxy, served these.
        served_by_ingress_replicas(lambda: httpx.get(f"{url}/v1/models", timeout=30), stats_port=SERVE_PORT + 1)
        # ... whose stats page and Prometheus endpoint listen on loopback only (Serve binds them to every
        # interface; omni_serve/cli/haproxy_loopback.sh), like the API itself.
        listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN"]
        for port in (SERVE_PORT, SERVE_PORT + 1, SERVE_PORT + 2):
            assert {a.ip for a in listening if a.port == port} == {"127.0.0.1"}, (port, listening)
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(timeout=120)
        reader.join(timeout=30)
    output = "\n".join(lines)
    assert make.returncode == -signal.SIGTERM, output  # make re-raises the signal after its child exited 0
    ours = [x for x in lines if x.startswith("omni_serve")]
    assert ours[-2:] == ["omni_serve: stopping (Ctrl-C again forces it)", "omni_serve: stopped"], output
    assert not [word for word in BROKEN if word in output], output
    assert not [word for word in NOISE if word in output], output
    assert "pip" not in output and re.match(r"omni_serve: starting tiny_omni.yaml", ours[0]), output
    with pytest.raises(httpx.TransportError):  # Serve's proxy went with the cluster
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.integration
def test_plain_serve_run_logs_the_ready_line_too(tiny_omni) -> None:
    """The ingress logs the line itself once Serve runs the whole application (seen in `serve run`'s output)."""
    import ray

    url = f"http://127.0.0.1:{HTTP_PORT}"
    expected = f"omni_serve ready: API {url}/v1 | playground {url}/ | tiny-qwen3-omni: thinker -> talker -> code2wav"
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    wait_until(
        lambda: any(expected in f.read_text(errors="replace") for f in logs.glob("replica_omni_ingress_*.log")),
        60,
        f"the ready line in {logs}/replica_omni_ingress_*.log",
        interval_s=0.5,
    )


def test_a_launcher_whose_first_process_group_is_gone_stays_in_its_own(tmp_path: Path) -> None:
    """`(python -m omni_serve.cli.run ... &)` from a script: the launcher moves to a group of its own while Ray
    starts, then back; by then the group it came from may have no member left (the shell and the subshell
    exited), and moving back fails (EPERM). The launcher goes on in its own group (was: a traceback after Ray
    had started)."""
    out = tmp_path / "out"
    code = (
        "import os, time, psutil\n"
        "from omni_serve.cli.run import _in_own_process_group\n"
        "first = os.getpgrp()\n"
        "def others():\n"
        "    for p in psutil.process_iter():\n"
        "        try:\n"
        "            yield p.pid != os.getpid() and os.getpgid(p.pid) == first\n"
        "        except (psutil.Error, OSError):\n"
        "            pass\n"
        "def start():\n"
        "    deadline = time.monotonic() + 30  # never outlive the test\n"
        "    while any(others()):  # until the shell and the subshell have exited\n"
        "        if time.monotonic() > deadline: return False\n"
        "        time.sleep(0.05)\n"
        "    return True\n"
        "print(_in_own_process_group(start) and os.getpgrp() == os.getpid())\n"
    )
    script = tmp_path / "launcher.py"
    script.write_text(code)
    subprocess.run(["sh", "-c", f"({sys.executable} {script} > {out} 2>&1 &)"], start_new_session=True, check=True)
    wait_until(lambda: out.exists() and out.read_text().strip(), 60, "the launcher's answer")
    assert out.read_text().strip() == "True", out.read_text()
