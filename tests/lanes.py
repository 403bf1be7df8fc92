"""`make test`'s suite as two pytest processes side by side, one per lane (``--lane``, tests/conftest.py).

``cluster``: every test on the session's Ray cluster, one graph at a time, in the order conftest sorts them.
``local``: the tests that never start it (engines in the test's own process, `make serve` in a cluster of its own,
unit tests). The cluster lane alone leaves the two cores about 30 % idle (replies awaited, timeouts, keep-alives);
the local lane runs in that idle time instead of after it (docs/testing.md, "Two lanes"), at a lower CPU priority
(:data:`LOCAL_NICENESS`, inherited by every process it starts): the cluster lane is the longer, and where both
want the cores it keeps them, so the local lane takes what it leaves instead of slowing it. Its output goes to a
file, printed once both have ended, so the terminal shows one run at a time.

    python -m tests.lanes PYTEST-ARGS...

Exit status: the first lane's that failed (one with no test selected, pytest's 5, counts as passed while the
other ran tests). ``--junitxml=PATH`` gives each lane its own report: PATH with ``-cluster`` or ``-local`` before
its suffix.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
# The local lane's niceness (nice(1)): at 10 the kernel's scheduler weighs a process about a tenth of one at 0.
LOCAL_NICENESS = 10


def lane_args(args: list[str], lane: str) -> list[str]:
    """The pytest arguments of one lane: ``args`` with ``--lane`` and, for a junit report, the lane's own path."""

    def own(arg: str) -> str:
        if not arg.startswith("--junitxml="):
            return arg
        path = Path(arg.removeprefix("--junitxml="))
        return f"--junitxml={path.with_name(f'{path.stem}-{lane}{path.suffix}')}"

    return [*map(own, args), f"--lane={lane}"]


def status(codes: list[int]) -> int:
    """One exit status for the lanes' (see the module's docstring)."""
    failed = [code for code in codes if code not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return 0 if 0 in codes else NO_TESTS


def priority(lane: str) -> list[str]:
    """What one lane's command line starts with: ``nice`` for the local lane, nothing for the cluster lane."""
    return ["nice", "-n", str(LOCAL_NICENESS)] if lane == "local" else []


def command(args: list[str], lane: str) -> list[str]:
    """One lane's command line: pytest with the lane's arguments, at the lane's priority."""
    return [*priority(lane), sys.executable, "-m", "pytest", *lane_args(args, lane)]


def main(args: list[str]) -> int:
    with tempfile.TemporaryFile("w+") as log:
        local = subprocess.Popen(command(args, "local"), stdout=log, stderr=subprocess.STDOUT)
        try:
            cluster = subprocess.call(command(args, "cluster"))
        finally:
            local.wait()  # Ctrl-C reaches both (one process group); a failing cluster lane still waits for it
        log.seek(0)
        print("\n======== the local lane (beside the cluster lane above) ========", flush=True)
        sys.stdout.write(log.read())
    return status([cluster, local.returncode])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
