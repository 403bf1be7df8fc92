"""Shared fixtures: one real Ray cluster per test session, graphs deployed with the real `serve run` CLI.

Two helpers every test module uses instead of its own copy: :func:`graph_variant` (a shipped graph
with declared changes, for ``Graphs.deploy``) and :func:`wait_until` (polling with a deadline).
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

from omni_serve.cli.launch import deploy_config, graph_file_config, wait_healthy
from omni_serve.cli.run import haproxy_environment

# Ray 2.60's token authentication stays on, as for any new local cluster: every process that talks to a
# test cluster (`serve run`, the replicas, the multinode clusters' raylets, `ray.util.state`) authenticates.
# The token is this session's own, in the environment they all inherit, so Ray writes no ~/.ray/auth_token
# and sessions running side by side never share or race for one. (RAY_AUTH_MODE=disabled, set outside,
# still turns it off.)
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Ray starts its workers (Serve's controller, proxies, replicas and the engine processes they spawn) at its
# raylet's niceness + 15 (worker_niceness). Here they run at the niceness of the test process that started the
# cluster, as Ray's own job manager runs its drivers: `make test`'s lanes (tests/lanes.py) set the priorities, and
# at + 15 the session cluster's replicas lost the cores to the lanes beside it (at 0 then, 10 now) instead of
# keeping them.
os.environ.setdefault("RAY_worker_niceness", "0")

HTTP_PORT = int(os.environ.get("OMNI_SERVE_TEST_PORT", "18765"))
METRICS_PORT = HTTP_PORT + 1  # Prometheus endpoint of the session cluster's node
# How often every process of the session cluster reports its metrics to the node's agent (Ray's default: 10 s).
# Each report wakes every process and the agent: with an idle tiny graph, at 1 s the dashboard agent took 0.057
# of a core and the GCS 0.031, at 10 s 0.017 and 0.012 (docs/testing.md). tests/test_metrics.py waits for a
# report by this interval.
METRICS_REPORT_INTERVAL_S = 5

# Ray's log monitor forwards workers' output to drivers (the session's driver sets log_to_driver=False) and
# re-lists the session's log files every 0.1 s while there are under 1,000: across a run, with every replica
# and engine process a suite starts leaving its files, it took ~150 CPU-seconds. The tests read the log files
# themselves; list them every 5 s.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")

# The session cluster runs Serve's HAProxy ingress, as the cluster `make serve` starts does (its environment,
# omni_serve.cli.run.haproxy_environment), so every graph is tested behind what users run. Its stats and
# Prometheus ports are the session's own (docs/testing.md, "Ports"), clear of a `make serve` a test starts beside
# it. RAY_SERVE_ENABLE_HA_PROXY=0 outside (tests/lanes.py sets it for the multinode lane): Serve's Python proxy.
os.environ.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", str(HTTP_PORT + 40))
os.environ.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", str(HTTP_PORT + 41))
haproxy_environment()

T = TypeVar("T")
Mutate = Callable[[dict[str, Any]], None]
ALL = "*"  # in graph_variant's by-name changes: every deployment / every stage


def wait_until(
    predicate: Callable[[], T], timeout_s: float, what: str | Callable[[], str], interval_s: float = 0.2
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that; fail naming ``what`` at the deadline.

    ``what`` may be a callable, called only on failure (to show the state last seen). The timeout is
    a hang guard, never a measurement: a test that needs "within N s" asserts it itself.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {described} (last: {result!r})", pytrace=False)
        time.sleep(interval_s)


def _merge(into: dict[str, Any], changes: Mapping[str, Any]) -> None:
    """Deep-merge ``changes`` into ``into``: mappings merge key by key, anything else replaces."""
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(dict(value) if isinstance(value, Mapping) else value)


# The multinode lane runs at a lower CPU priority beside the cluster lane (tests/lanes.py): a replica its tests
# lose is replaced more slowly than on an idle machine (a talker's replacement took over the tiny graph's 100 s
# stage timeout, a 504 where the tests expect a 200 or a clean 503). Their graphs let a stage be silent this long,
# and Serve's proxy wait for the request as long.
RECOVERY_TIMEOUT_S = 600


def patient(variant: Mutate) -> Mutate:
    """``variant``, then the stage timeout and Serve's request timeout at :data:`RECOVERY_TIMEOUT_S` (and a
    minute more for Serve, so the client gets the API's 504 first)."""

    def mutate(config: dict[str, Any]) -> None:
        variant(config)
        config["applications"][0]["args"]["stage_timeout_s"] = RECOVERY_TIMEOUT_S
        config.setdefault("http_options", {})["request_timeout_s"] = RECOVERY_TIMEOUT_S + 60

    return mutate


def _by_name(items: list[dict[str, Any]], changes: Mapping[str, Any], what: str) -> dict[str, list[Any]]:
    """Item name -> the changes for it (``*`` first, then its own); a name the graph lacks is an error."""
    names = [item["name"] for item in items]
    unknown = sorted(set(changes) - set(names) - {ALL})
    if unknown:
        raise KeyError(f"the graph has no {what} {unknown} (it has {names})")
    return {name: [changes[key] for key in (ALL, name) if key in changes] for name in names}


def graph_variant(
    *,
    fixed_replicas: int | Mapping[str, int] | None = None,
    deployments: Mapping[str, Mapping[str, Any]] | None = None,
    engine_args: Mapping[str, Mapping[str, Any]] | None = None,
    stages: Mapping[str, Mapping[str, Any]] | None = None,
    args: Mapping[str, Any] | None = None,
    policy_kwargs: Mapping[str, Any] | None = None,
) -> Mutate:
    """The ``mutate`` callback for :meth:`Graphs.deploy` that turns a graph file into a variant, declaratively.

    - ``fixed_replicas``: replica counts that do not change, for every deployment or by deployment name
      (``*``: the rest): an autoscaling deployment's ``min_replicas``, ``initial_replicas`` and
      ``max_replicas`` all set to it, the others' ``num_replicas``. The autoscaling policy stays: it is
      part of the code version, so a variant that changed it could not be deployed over the graph in place.
    - ``deployments``: Serve options deep-merged into each named deployment (``*``: all).
    - ``engine_args``: deep-merged into each named stage's ``engine_args`` (``*``: all stages).
    - ``stages``: deep-merged into each named stage's own settings (e.g. ``handoff_padding_bytes``).
    - ``args``: deep-merged into the application's graph ``args`` (e.g. ``stage_timeout_s``).
    - ``policy_kwargs``: deep-merged into the application's autoscaling policy kwargs.

    A deployment or stage name the graph does not have raises ``KeyError``: a typo never
    deploys the unchanged graph.
    """

    def mutate(config: dict[str, Any]) -> None:
        (app,) = config["applications"]
        if fixed_replicas is not None:
            counts = {ALL: fixed_replicas} if isinstance(fixed_replicas, int) else fixed_replicas
            for deployment, count in zip(
                app["deployments"], _by_name(app["deployments"], counts, "deployment").values(), strict=True
            ):
                if not count:
                    raise KeyError(f"fixed_replicas names no count for deployment {deployment['name']!r} (nor '*')")
                if "autoscaling_config" in deployment:
                    bounds = ("min_replicas", "initial_replicas", "max_replicas")
                    deployment["autoscaling_config"].update(dict.fromkeys(bounds, count[-1]))
                else:
                    deployment["num_replicas"] = count[-1]
        for deployment, merges in zip(
            app["deployments"], _by_name(app["deployments"], deployments or {}, "deployment").values(), strict=True
        ):
            for merge in merges:
                _merge(deployment, merge)
        graph_stages = app["args"]["stages"]
        for stage, merges in zip(
            graph_stages, _by_name(graph_stages, engine_args or {}, "stage").values(), strict=True
        ):
            for merge in merges:
                _merge(stage.setdefault("engine_args", {}), merge)
        for stage, merges in zip(graph_stages, _by_name(graph_stages, stages or {}, "stage").values(), strict=True):
            for merge in merges:
                _merge(stage, merge)
        _merge(app["args"], args or {})
        if policy_kwargs:
            if "autoscaling_policy" not in app:
                raise KeyError("policy_kwargs: the graph has no autoscaling_policy")
            _merge(app["autoscaling_policy"].setdefault("policy_kwargs", {}), policy_kwargs)

    return mutate


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster for the whole session; torn down (Serve, then Ray) at the end."""
    import ray
    from ray import serve

    ray.init(
        address="local",  # never join a cluster someone started with `ray start`
        num_cpus=4,
        include_dashboard=False,
        namespace="serve",
        log_to_driver=False,
        _metrics_export_port=METRICS_PORT,
        _system_config={"metrics_report_interval_ms": METRICS_REPORT_INTERVAL_S * 1000},
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# What of an application's config is its code version: Serve restarts every replica of it when one of these
# changes (ray.serve._private.deploy_utils.get_app_code_version) and applies anything else in place.
CODE_VERSION = ("import_path", "runtime_env", "args", "autoscaling_policy")


def _matches(ours: Any, theirs: Any) -> bool:
    """``theirs`` (Serve's view of a deployment's config) carries every value ``ours`` sets."""
    if isinstance(ours, Mapping):
        return isinstance(theirs, Mapping) and all(_matches(v, theirs.get(k)) for k, v in ours.items())
    return ours == theirs


class Graphs:
    """Deploys graph files exactly as a user does: `serve run --non-blocking FILE` against the session cluster."""

    def __init__(self, address: str):
        self.address = address
        self.base_url = f"http://127.0.0.1:{HTTP_PORT}"
        self.current: tuple[str, Mutate | None] | None = None  # the graph file and variant deployed last
        self.deployed: dict[str, Any] | None = None  # its Serve config

    def deploy(self, graph: str | Path, mutate: Mutate | None = None, *, fresh: bool = False) -> dict[str, Any]:
        """Deploy the graph (or a variant of it). A change Serve applies to running replicas (options, replica
        counts, a deployment's user_config: omni_serve.graph.settings) is deployed over what runs, in seconds;
        a graph whose code version differs (other args, another graph file), or any graph when ``fresh`` (a
        test that watches it start), replaces what runs, deleted first so that no old replica answers for it."""
        config = graph_file_config(graph, HTTP_PORT, mutate)
        if fresh or not self._in_place(config):
            self.delete_all()
        deploy_config(config, self.address)
        self.current, self.deployed = (str(graph), mutate), config
        return config

    def _in_place(self, config: dict[str, Any]) -> bool:
        if self.deployed is None:
            return False
        before = {app["name"]: app for app in self.deployed["applications"]}
        after = {app["name"]: app for app in config["applications"]}
        return before.keys() == after.keys() and all(
            before[name].get(key) == app.get(key) for name, app in after.items() for key in CODE_VERSION
        )

    def _applied(self) -> bool:
        """Serve's controller runs the deployed config: every deployment HEALTHY with its options and user_config
        (its view changes only once the controller has taken the config, unlike a status read just after)."""
        from ray.serve.context import _get_global_client  # Serve's own details, as its REST API serves them

        assert self.deployed is not None
        details = _get_global_client().get_serve_details()["applications"]
        for app in self.deployed["applications"]:
            served = details.get(app["name"])
            if served is None or served["status"] != "RUNNING":
                return False
            for ours in app.get("deployments", []):
                theirs = served["deployments"].get(ours["name"])
                if theirs is None or theirs["status"] != "HEALTHY":
                    return False
                config = theirs["deployment_config"]
                if config.get("user_config") != ours.get("user_config") or not _matches(ours, config):
                    return False
        return True

    @staticmethod
    def replicas(app: str = "omni") -> dict[str, set[str]]:
        """Deployment -> the ids of its running replicas (a replica restarted gets a new one)."""
        from ray.serve.context import _get_global_client

        deployments = _get_global_client().get_serve_details()["applications"][app]["deployments"]
        return {
            name: {r["replica_id"] for r in d["replicas"] if r["state"] == "RUNNING"} for name, d in deployments.items()
        }

    def ensure(self, graph: str | Path, variant: Mutate | None = None) -> None:
        """Deploy the graph (or that variant of it: the same `graph_variant` object) unless it is what runs now
        (saves a redeploy per test module sharing it), then wait until Serve reports it RUNNING (a replica a
        module before killed is replaced) and it answers /health."""
        if self.current != (str(graph), variant):
            self.deploy(graph, variant)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 300) -> None:
        """What was deployed last runs (:meth:`_applied`) and answers /health; fails at once if it failed to deploy."""
        wait_healthy(self.base_url, timeout_s, replaced=True)
        wait_until(self._applied, timeout_s, "Serve to run the deployed config")

    @contextlib.contextmanager
    def own(self, graph: str | Path, timeout_s: float = 3000, mutate: Mutate | None = None) -> Iterator[Graphs]:
        """A module's own graph (changed by ``mutate``, as :meth:`deploy` takes it): deployed and healthy (its start
        printed), deleted when the module ends so its engines do not hold the cores and memory the next module needs."""
        started = time.perf_counter()
        self.deploy(graph, mutate=mutate)
        self.wait_healthy(timeout_s=timeout_s)
        print(f"\n{graph} healthy in {time.perf_counter() - started:.1f} s")
        try:
            yield self
        finally:
            self.delete()

    @contextlib.contextmanager
    def own_beside(
        self, graph: str | Path, oracle: Callable[[], T], mutate: Mutate | None = None
    ) -> Iterator[tuple[Graphs, T]]:
        """:meth:`own`, with ``oracle`` (native vLLM-Omni started, asked and stopped) run in a thread while the graph
        deploys: (the graph, what the oracle returned). The two starts share the cores, and neither waits for the
        other's."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            native = pool.submit(oracle)
            with self.own(graph, mutate=mutate) as deployed:
                yield deployed, native.result()

    @staticmethod
    def handle(deployment: str, app: str = "omni"):
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=app)

    def delete(self, app: str = "omni") -> None:
        from ray import serve

        self.current = self.deployed = None
        serve.delete(app)

    def delete_all(self) -> None:
        from ray import serve

        self.current = self.deployed = None
        for app in list(serve.status().applications):
            serve.delete(app)


@pytest.fixture(scope="session")
def graphs(ray_cluster: str) -> Graphs:
    return Graphs(ray_cluster)


@pytest.fixture(scope="module")
def graph(deployed: tuple[Graphs, Any]) -> Graphs:
    """The graph of a module that deploys it beside native vLLM-Omni (its ``deployed`` fixture, from
    :meth:`Graphs.own_beside`: the graph, native's replies); a module deploying its graph alone defines its own."""
    return deployed[0]


@pytest.fixture(scope="module")
def oracle(deployed: tuple[Graphs, Any]) -> Any:
    """Native vLLM-Omni's replies beside such a module's graph (see :func:`graph`)."""
    return deployed[1]


@contextlib.contextmanager
def serve_driver(address: str) -> Iterator[None]:
    """This process as the driver of the cluster at ``address``; on leaving, Serve shut down, then the driver."""
    import ray

    try:
        ray.init(address=address, namespace="serve", log_to_driver=False)
        yield
    finally:
        try:
            if ray.is_initialized():
                from ray import serve

                serve.shutdown()
        finally:
            ray.shutdown()


def one_replica_per_stage(graphs: Graphs) -> Graphs:
    """The tiny graph with one replica per stage (a module's fixture, given `tiny_omni`), so one handle call sees a
    stage's whole state."""
    from ray import serve

    graphs.ensure("tiny_omni.yaml")
    replicas = serve.status().applications["omni"].deployments
    if any(sum(replicas[s].replica_states.values()) != 1 for s in ("thinker", "talker", "code2wav")):
        graphs.deploy("tiny_omni.yaml", graph_variant(fixed_replicas=1))
        graphs.wait_healthy()
    return graphs


LANES = ("cluster", "local", "multinode")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        choices=LANES,
        help="run one lane of the suite (tests/lanes.py runs them side by side): cluster = the tests on the session's "
        "Ray cluster, multinode = the tests on multi-raylet clusters of their own, local = the rest",
    )


def lane(item: pytest.Item) -> str:
    """``cluster`` for a test on the session's Ray cluster (its fixtures start it), ``multinode`` for one marked so
    (multi-raylet clusters of its own, in a process where Ray was never initialized), ``local`` for the rest:
    engines in the test's process, unit tests, `make serve` in a cluster of its own."""
    if "ray_cluster" in getattr(item, "fixturenames", ()):
        return "cluster"
    return "multinode" if item.get_closest_marker("multinode") else "local"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the unmodified tiny graph first and back to back, then the tests on variants of it, then the rest
    of their modules, then the other modules (alphabetical order otherwise).

    `Graphs.ensure` redeploys the tiny graph whenever a graph of another kind ran in between; in alphabetical
    order that cost a 35-40 s redeploy about ten times per session. A module shares the tiny graph when one of
    its tests asks for the `tiny_omni` fixture (its one-replica form `one_replica_per_stage` included). Tests
    marked ``tiny_variant(rank)`` deploy a variant of it: rank 0 variants Serve applies to the running replicas
    (options, replica counts, user_config: `Graphs.deploy` deploys them over the graph in seconds), 1 tests
    that start so and end on other args (a restart), 2 tests that need a deploy of their own (other args, or
    one they watch start); they run straight after the tests on the plain graph, by rank, so that no restart
    stands between the plain graph and an in-place variant (the rest of the tiny graph's modules may deploy
    other graphs: a full run found the image graph of test_playground between them). A module whose tests
    are split so sets its module-scoped fixtures up twice (a media server, a browser: seconds). Modules marked
    ``shares_graph(KEY)`` (another graph, or one variant of a graph, through `Graphs.ensure`) run back to back
    with the others of that key.
    """

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    def on_tiny(item: pytest.Item) -> bool:
        return "tiny_omni" in getattr(item, "fixturenames", ())

    position = {name: i for i, name in enumerate(dict.fromkeys(map(module, items)))}
    shared = {module(item) for item in items if on_tiny(item)}
    graph_of = {module(item): m.args[0] for item in items if (m := item.get_closest_marker("shares_graph"))}
    first: dict[str, int] = {}  # graph file -> the position of the first module on it
    for name in sorted(graph_of, key=position.__getitem__):
        first.setdefault(graph_of[name], position[name])

    def rank(item: pytest.Item) -> tuple[int, int, int, int, int]:
        name = module(item)
        group = first[graph_of[name]] if name in graph_of else position[name]
        if variant := item.get_closest_marker("tiny_variant"):  # straight after the plain graph's tests
            return 0, 1, variant.args[0], group, position[name]
        if name in shared:  # the plain graph's tests, then the rest of their modules (which may deploy others)
            return 0, (0 if on_tiny(item) else 2), 0, 0, position[name]
        if name in graph_of:
            return 1, 0, 0, group, position[name]
        return 2, 0, 0, 0, position[name]

    items.sort(key=rank)  # stable: a module's tests keep their order within each rank
    if config is not None and (only := config.getoption("lane")):
        config.hook.pytest_deselected(items=[item for item in items if lane(item) != only])
        items[:] = [item for item in items if lane(item) == only]


@pytest.fixture(scope="module")
def tiny_omni(graphs: Graphs) -> Graphs:
    """The CPU default graph from graphs/tiny_omni.yaml, healthy; shared by consecutive modules."""
    graphs.ensure("tiny_omni.yaml")
    return graphs
