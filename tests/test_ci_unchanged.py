""".ci/unchanged.py: an install step is skipped only while its inputs and the installed packages are as recorded."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("unchanged", ROOT / ".ci" / "unchanged.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RECORDS", tmp_path / "records")
    return module


def test_a_step_is_skipped_only_while_its_inputs_and_the_packages_are_as_recorded(unchanged, tmp_path, monkeypatch):
    script = tmp_path / "install.sh"
    script.write_text("pip install thing==1\n")
    files = [str(script)]
    assert unchanged.main("check", "step", files) == 1  # never ran here
    assert unchanged.main("save", "step", files) == 0
    assert unchanged.main("check", "step", files) == 0
    assert unchanged.main("check", "other-step", files) == 1

    script.write_text("pip install thing==2\n")  # an edited script or pin: another record
    assert unchanged.main("check", "step", files) == 1
    script.write_text("pip install thing==1\n")
    assert unchanged.main("check", "step", files) == 0

    real = unchanged.installed()
    assert "omni-serve==" not in real and "pytest==" in real  # the project's own editable install left out
    monkeypatch.setattr(unchanged, "installed", lambda: real + "something-new==1.0\n")  # a package moved
    assert unchanged.main("check", "step", files) == 1
