"""The shared test helpers of tests/conftest.py: graph variants and polling (fast; no cluster)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from omni_serve.cli.launch import load_graph_file
from tests.conftest import graph_variant, wait_until


def variant(**changes) -> dict:
    config = load_graph_file("tiny_omni.yaml")
    graph_variant(**changes)(config)
    return config["applications"][0]


def test_fixed_replicas_pin_the_autoscaling_bounds_and_keep_the_policy() -> None:
    """The policy is part of the code version: dropping it would make every such variant a restart."""
    app = variant(fixed_replicas={"*": 1, "talker": 2})
    assert app["autoscaling_policy"] == load_graph_file("tiny_omni.yaml")["applications"][0]["autoscaling_policy"]
    by_name = {d["name"]: d for d in app["deployments"]}
    assert by_name["ingress"]["num_replicas"] == 1  # the one deployment that does not autoscale
    bounds = {
        name: {k: d["autoscaling_config"][k] for k in ("min_replicas", "initial_replicas", "max_replicas")}
        for name, d in by_name.items()
        if name != "ingress"
    }
    assert bounds == {
        "thinker": dict.fromkeys(("min_replicas", "initial_replicas", "max_replicas"), 1),
        "talker": dict.fromkeys(("min_replicas", "initial_replicas", "max_replicas"), 2),
        "code2wav": dict.fromkeys(("min_replicas", "initial_replicas", "max_replicas"), 1),
    }
    assert by_name["talker"]["autoscaling_config"]["target_ongoing_requests"] == 2  # the rest stays
    assert not any("num_replicas" in d for name, d in by_name.items() if name != "ingress")


def test_graphs_deploy_in_place_only_what_keeps_the_code_version() -> None:
    """Graphs.deploy deletes first only where Serve would restart the replicas anyway (their code version changed)."""
    from tests.conftest import Graphs

    graphs = Graphs("unused")
    graphs.deployed = load_graph_file("tiny_omni.yaml")

    def in_place(**changes: Any) -> bool:
        config = load_graph_file("tiny_omni.yaml")
        graph_variant(**changes)(config)
        return graphs._in_place(config)

    assert in_place(fixed_replicas=1, deployments={"talker": {"user_config": {"min_step_s": 1.0}}})
    assert in_place(deployments={"ingress": {"ray_actor_options": {"runtime_env": {"env_vars": {"K": "v"}}}}})
    assert not in_place(args={"stage_timeout_s": 4})
    assert not in_place(engine_args={"talker": {"min_step_s": 1.0}})
    assert not in_place(policy_kwargs={"max_engine_waiting": {"thinker": 0}})
    graphs.deployed = None
    assert not in_place()  # nothing known to run: deploy from scratch


def test_deployment_options_stage_settings_and_engine_args_deep_merge() -> None:
    app = variant(
        deployments={"ingress": {"ray_actor_options": {"runtime_env": {"env_vars": {"K": "v"}}}}},
        engine_args={"*": {"dtype": "float32"}, "talker": {"min_step_s": 2.0}},
        stages={"*": {"handoff_padding_bytes": 8}},
        args={"stage_timeout_s": 4},
        policy_kwargs={"max_engine_waiting": {"thinker": 0}},
    )
    ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
    # Deep: the graph's own env var (the ingress's user code on the replica's loop) stays beside the new one.
    env = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "K": "v"}
    assert ingress["ray_actor_options"] == {"num_cpus": 0.1, "runtime_env": {"env_vars": env}}
    assert all(s["handoff_padding_bytes"] == 8 for s in app["args"]["stages"])
    stages = {s["name"]: s["engine_args"] for s in app["args"]["stages"]}
    assert all(a["dtype"] == "float32" and a["model"] == "tiny" for a in stages.values())
    assert stages["talker"]["min_step_s"] == 2.0 and "min_step_s" not in stages["thinker"]
    assert stages["talker"]["codec_chunk_frames"] == 25  # untouched keys stay
    assert app["args"]["stage_timeout_s"] == 4
    kwargs = app["autoscaling_policy"]["policy_kwargs"]
    assert kwargs == {"min_ratios": {"code2wav": {"talker": 0.5}}, "max_engine_waiting": {"thinker": 0}}


@pytest.mark.parametrize(
    "changes",
    [{"deployments": {"taker": {}}}, {"engine_args": {"coder": {}}}, {"fixed_replicas": {"talker": 2}}],
    ids=["deployment", "stage", "no count"],
)
def test_a_name_the_graph_lacks_is_an_error(changes) -> None:
    with pytest.raises(KeyError):
        variant(**changes)


def test_wait_until_returns_the_value_or_fails_naming_what() -> None:
    calls = iter([0, None, {"ready": True}])
    assert wait_until(lambda: next(calls), 5, "a value", interval_s=0) == {"ready": True}
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"waiting for nothing \(seen 3\)"):
        wait_until(lambda: False, 0.2, lambda: "nothing (seen 3)", interval_s=0.05)
    assert time.monotonic() - started < 2


def test_the_tiny_graph_tests_first_then_their_modules_variants_then_modules_sharing_a_graph() -> None:
    """The run order that saves redeploys (conftest.pytest_collection_modifyitems); fails if a test on a variant runs
    between two on the tiny graph, if a test that may deploy another graph (the rest of a tiny-graph module) runs
    between the plain graph and its variants, if a variant that restarts the graph runs before one deployed in
    place, or if two modules on one shared graph are split by another module."""
    from types import SimpleNamespace

    from tests.conftest import pytest_collection_modifyitems

    def item(nodeid: str, *fixtures: str, shares: str | None = None, variant: int | None = None) -> Any:
        markers = {"shares_graph": shares and (shares,), "tiny_variant": variant is not None and (variant,)}
        return SimpleNamespace(
            nodeid=nodeid,
            fixturenames=fixtures,
            get_closest_marker=lambda name: SimpleNamespace(args=markers[name]) if markers[name] else None,
        )

    items = [
        item("tests/test_a.py::unit"),
        item("tests/test_b.py::on_tiny", "graphs", "tiny_omni"),
        item("tests/test_b.py::on_a_variant", "graphs"),
        item("tests/test_b.py::on_tiny_again", "tiny_omni"),
        item("tests/test_c.py::llm", shares="single_stage_llm.yaml"),
        item("tests/test_d.py::own_graph", "graphs"),
        item("tests/test_e.py::on_tiny", "tiny_omni"),
        item("tests/test_e.py::restarts_it", "graphs", variant=1),
        item("tests/test_f.py::llm_too", shares="single_stage_llm.yaml"),
        item("tests/test_g.py::replaces_it", "graphs", variant=2),
        item("tests/test_h.py::in_place", "graphs", variant=0, shares="padded"),
        item("tests/test_i.py::in_place", "graphs", variant=0),
        item("tests/test_j.py::in_place_too", "graphs", variant=0, shares="padded"),
    ]
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.nodeid.split("/")[1] for i in items] == [
        "test_b.py::on_tiny",
        "test_b.py::on_tiny_again",
        "test_e.py::on_tiny",
        "test_h.py::in_place",
        "test_j.py::in_place_too",
        "test_i.py::in_place",
        "test_e.py::restarts_it",
        "test_g.py::replaces_it",
        "test_b.py::on_a_variant",
        "test_c.py::llm",
        "test_f.py::llm_too",
        "test_a.py::unit",
        "test_d.py::own_graph",
    ]


def test_the_lanes_split_the_selected_tests_by_whether_they_start_the_session_cluster() -> None:
    """`make test`'s lanes (tests/lanes.py) together select every test once: test_chat_api's tests (on the tiny
    graph) in the cluster lane, test_grammar's (unit tests) and test_placement's checks of files in the local one,
    test_placement's multinode test in the multinode lane. Fails if a lane runs another's tests (two processes
    would deploy the same graphs, or a multinode cluster would start in a process where Ray runs) or drops its own."""
    import subprocess
    import sys

    modules = ["tests/test_chat_api.py", "tests/test_grammar.py", "tests/test_placement.py"]
    run = subprocess.run(
        [sys.executable, "-m", "tests.lanes", "--collect-only", "-q", "-p", "no:cacheprovider", *modules],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    ids = [line for line in run.stdout.splitlines() if line.startswith("tests/")]
    multinode, local = run.stdout.index("the multinode lane"), run.stdout.index("the local lane")
    lanes = {
        "cluster": [i for i in ids if run.stdout.index(i) < multinode],
        "multinode": [i for i in ids if multinode < run.stdout.index(i) < local],
        "local": [i for i in ids if run.stdout.index(i) > local],
    }
    assert lanes["cluster"] and all(i.startswith("tests/test_chat_api.py::") for i in lanes["cluster"]), lanes
    assert {i.split("::")[0] for i in lanes["local"]} == {"tests/test_grammar.py", "tests/test_placement.py"}, lanes
    [test] = lanes["multinode"]
    assert test == "tests/test_placement.py::test_stages_land_on_their_node_type_and_fail_over_within_it", lanes
    assert len(ids) == len(set(ids)), ids


def test_the_lanes_beside_the_cluster_lane_run_at_a_lower_cpu_priority() -> None:
    """Every process the multinode and local lanes start is niced by BESIDE_NICENESS (nice(1) is inherited); the
    cluster lane's are not. Fails if a lane loses its prefix or the cluster lane gets one."""
    import os
    import subprocess
    import sys

    from tests.lanes import BESIDE, BESIDE_NICENESS, priority

    child = "import os; print(os.nice(0))"  # a process the lane's process starts
    probe = f"import subprocess, sys; print(subprocess.check_output([sys.executable, '-c', {child!r}]).decode())"
    base = os.nice(0)
    for lane in ("cluster", *BESIDE):
        niceness = int(subprocess.check_output([*priority(lane), sys.executable, "-c", probe], timeout=60))
        assert niceness == min(base + (0 if lane == "cluster" else BESIDE_NICENESS), 19), lane


def test_the_lanes_end_with_each_lanes_exit_status_and_failed_tests(tmp_path) -> None:
    """The last lines of `make test` name every lane's failures (CI keeps only a failed run's tail; 2026-12-02 it
    showed the local lane passing and not which lane failed). Three lanes each run a module of a passing, a
    failing and an erroring test (its own conftest takes ``--lane`` and selects everything). Fails if the summary
    goes, misses a lane or a failure, or lists the passing test."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_addoption(parser):\n    parser.addoption('--lane')\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('fixture')\n"
    )
    (tmp_path / "test_mixed.py").write_text(
        "def test_passes():\n    pass\ndef test_fails():\n    assert 0\ndef test_errors(broken):\n    pass\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.lanes",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    tail = run.stdout[run.stdout.rindex("======== the lanes ========") :].splitlines()[1:]
    named = [re.sub(r"\S*/", "", line.split(" - ")[0]) for line in tail]  # the path's folders, the message: not ours
    each = ["  FAILED test_mixed.py::test_fails", "  ERROR test_mixed.py::test_errors"]
    assert named == [line for lane in ("cluster", "multinode", "local") for line in (f"{lane}: exit status 1", *each)]


def test_a_lane_with_no_test_selected_passes_while_the_other_ran_tests() -> None:
    from tests.lanes import lane_args, lane_environment, status

    assert lane_args(["-q", "--junitxml=/tmp/r/p.xml"], "local") == [
        "-q",
        "--junitxml=/tmp/r/p-local.xml",
        "--lane=local",
    ]
    environment = lane_environment("multinode", {"OMNI_SERVE_TEST_PORT": "20000", "PATH": "/bin"})
    assert environment == {
        "OMNI_SERVE_TEST_PORT": "20100",
        "RAY_SERVE_ENABLE_HA_PROXY": "0",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
        "PATH": "/bin",
    }
    assert lane_environment("local", {"OMNI_SERVE_TEST_PORT": "20000"}) == {"OMNI_SERVE_TEST_PORT": "20000"}
    assert status([0, 5]) == status([5, 0]) == status([0, 0]) == 0
    assert status([1, 0]) == status([5, 1]) == 1 and status([0, 2]) == 2 and status([5, 5]) == 5


# Offsets from the session's port that two modules use, and why they cannot collide: both modules run in the
# cluster lane, one after the other.
SHARED_PORT_OFFSETS = {10: {"test_videos.py", "test_vllm_omni_diffusion.py"}}


def test_each_port_offset_from_the_session_port_is_one_modules() -> None:
    """A port two modules bind at once fails one of them (2026-11-30: test_omni_input, cluster lane, and
    test_media_policy, local lane, both served media on the session port + 50 and + 51). Each ``HTTP_PORT + N``
    in the tests is one module's, but for the shares listed above."""
    import re
    from collections import defaultdict
    from pathlib import Path

    users: dict[int, set[str]] = defaultdict(set)
    for module in Path(__file__).parent.glob("*.py"):
        for offset in re.findall(r"\bHTTP_PORT \+ (\d+)", module.read_text()):
            users[int(offset)].add(module.name)
    assert users[50] == {"test_media_policy.py"}, users[50]  # the pattern finds what it is for
    shared = {offset: names for offset, names in users.items() if len(names) > 1}
    assert shared == SHARED_PORT_OFFSETS


def test_a_node_start_whose_raylet_died_is_made_again_once_what_it_left_is_stopped() -> None:
    """tests/fake_cluster.py's start_node: a start failing as Ray's does when a raylet dies waiting for its agent
    (ray-project/ray#65983) is made again, and the process it started is killed first (a head's GCS holds its
    port); any other error is the caller's at once. Fails if the retry, the kill or the narrowness goes."""
    import subprocess
    import sys

    import psutil

    from tests.fake_cluster import NODE_START_FAILED, start_node

    started: list[subprocess.Popen] = []

    def start() -> str:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        if len(started) == 1:
            raise Exception(f"{NODE_START_FAILED}. This could happen because ...")
        return "node"

    try:
        assert start_node(start) == "node" and len(started) == 2
        assert not psutil.pid_exists(started[0].pid) and started[1].poll() is None  # start_node waited for it
    finally:
        for process in started:
            process.kill()
            process.wait()

    calls = []

    def broken() -> str:
        calls.append(1)
        raise Exception("another failure")

    with pytest.raises(Exception, match="another failure"):
        start_node(broken)
    assert calls == [1]
