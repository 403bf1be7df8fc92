"""`make test`'s suite as pytest processes side by side, one per lane (``--lane``, tests/conftest.py).

``cluster``: every test on the session's Ray cluster, one graph at a time, in the order conftest sorts them.
``local``: the tests that never start it (engines in the test's own process, `make serve` in a cluster of its own,
unit tests). ``multinode``: the tests on multi-raylet clusters of their own, in a process where Ray was never
initialized, with Serve's Python proxy (every node of such a cluster is this machine: one HAProxy port each is
not to be had) on ports of their own (:data:`MULTINODE_PORT_OFFSET`).

The cluster lane is the longest; the multinode lane, then the local lane, run beside it (docs/testing.md, "Lanes"),
at a lower CPU priority (:data:`BESIDE_NICENESS`, inherited by every process they start): where both want the cores
the cluster lane keeps them, and the others take the time it leaves (alone it keeps the two cores ~75 % busy:
replies awaited, timeouts, keep-alives). The multinode lane goes first, while the cluster lane runs the tiny
graph's tests, which leave more of the cores than the engine families' graph starts at its end; the local lane,
whose waits held at this priority (since 6068239), takes what is left. The multinode clusters' Serve proxies get
:data:`MULTINODE_PROXY_TIMEOUT_S` for their ready and health checks (Serve's 5 and 10 s: niced, a proxy missed its
start), and their graphs give a lost replica's replacement time to start (tests/conftest.py, ``patient``). Their
output goes to a file, printed once every lane has ended, so the terminal shows one run at a time; the last lines are
each lane's exit status and the tests it failed, so that a log's tail (all CI keeps of a failed run) names them.

    python -m tests.lanes PYTEST-ARGS...

Exit status: the first lane's that failed (one with no test selected, pytest's 5, counts as passed while another
ran tests). ``--junitxml=PATH`` gives each lane its own report: PATH with ``-cluster``, ``-local`` or
``-multinode`` before its suffix.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
# The multinode lane's OMNI_SERVE_TEST_PORT, above the session's: its clusters' HTTP, GCS (+11) and dashboard
# (+12) ports must not be the session cluster's (HTTP, metrics +1) or those of its tests (+2 .. +51).
MULTINODE_PORT_OFFSET = 100
BESIDE = ("multinode", "local")  # one after the other, beside the cluster lane
# Their niceness (nice(1)): at 10 the kernel's scheduler weighs a process about a tenth of one at 0.
BESIDE_NICENESS = 10
# Serve's proxy ready and health check timeouts in the multinode lane's clusters (Serve's defaults: 5 and 10 s).
MULTINODE_PROXY_TIMEOUT_S = 60
# A line of pytest's short test summary (-rfE, its default) naming a test that failed or errored.
FAILURE = re.compile(r"^(FAILED|ERROR) \S+\.py\b")
# How long a lane's output is still read once its pytest has exited: a process its tests left running may hold the
# pipe open, and the lanes must not wait for it.
COPY_AFTER_EXIT_S = 10


def lane_args(args: list[str], lane: str) -> list[str]:
    """The pytest arguments of one lane: ``args`` with ``--lane`` and, for a junit report, the lane's own path."""

    def own(arg: str) -> str:
        if not arg.startswith("--junitxml="):
            return arg
        path = Path(arg.removeprefix("--junitxml="))
        return f"--junitxml={path.with_name(f'{path.stem}-{lane}{path.suffix}')}"

    return [*map(own, args), f"--lane={lane}"]


def lane_environment(lane: str, environ: dict[str, str]) -> dict[str, str]:
    """The environment of one lane's process: the multinode lane's ports and proxy (see the module's docstring)."""
    if lane != "multinode":
        return dict(environ)
    port = int(environ.get("OMNI_SERVE_TEST_PORT", "18765")) + MULTINODE_PORT_OFFSET  # conftest's default
    return {
        **environ,
        "OMNI_SERVE_TEST_PORT": str(port),
        "RAY_SERVE_ENABLE_HA_PROXY": "0",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(MULTINODE_PROXY_TIMEOUT_S),
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": str(MULTINODE_PROXY_TIMEOUT_S),
    }


def status(codes: list[int]) -> int:
    """One exit status for the lanes' (see the module's docstring)."""
    failed = [code for code in codes if code not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return 0 if 0 in codes else NO_TESTS


def priority(lane: str) -> list[str]:
    """What one lane's command line starts with: ``nice`` for the lanes beside the cluster lane, nothing for it."""
    return ["nice", "-n", str(BESIDE_NICENESS)] if lane in BESIDE else []


def command(args: list[str], lane: str) -> list[str]:
    """One lane's command line: pytest with the lane's arguments, at the lane's priority."""
    return [*priority(lane), sys.executable, "-m", "pytest", *lane_args(args, lane)]


def run(args: list[str], lane: str, out: IO[str]) -> tuple[int, list[str]]:
    """One lane's pytest, its output copied to ``out`` as it comes: its exit status and its failure lines."""
    environment = lane_environment(lane, dict(os.environ))
    failures: list[str] = []
    process = subprocess.Popen(
        command(args, lane), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment, text=True, bufsize=1
    )

    def copy() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            out.flush()
            if FAILURE.match(line):
                failures.append(line.rstrip())

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    code = process.wait()
    copier.join(COPY_AFTER_EXIT_S)
    return code, list(failures)


def summary(results: dict[str, tuple[int, list[str]]]) -> str:
    """The lines printed last: each lane's exit status, then the tests it failed (see the module's docstring)."""
    lines = ["", "======== the lanes ========"]
    for lane, (code, failures) in results.items():
        lines += [f"{lane}: exit status {code}", *(f"  {failure}" for failure in failures)]
    return "\n".join(lines) + "\n"


def main(args: list[str]) -> int:
    results: dict[str, tuple[int, list[str]]] = {}
    interrupted = threading.Event()
    with tempfile.TemporaryFile("w+") as log:

        def beside() -> None:
            for lane in BESIDE:
                if interrupted.is_set():  # Ctrl-C ended the lane before: start no other
                    return
                print(f"\n======== the {lane} lane (beside the cluster lane above) ========", file=log, flush=True)
                results[lane] = run(args, lane, log)

        others = threading.Thread(target=beside)
        others.start()
        try:
            results["cluster"] = run(args, "cluster", sys.stdout)
        except BaseException:
            interrupted.set()
            raise
        finally:
            others.join()  # Ctrl-C reaches every lane (one process group); a failing cluster lane still waits
        log.seek(0)
        sys.stdout.write(log.read())
    ran = {lane: results.get(lane, (1, ["(did not run)"])) for lane in ("cluster", *BESIDE)}
    sys.stdout.write(summary(ran))
    return status([code for code, _ in ran.values()])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
