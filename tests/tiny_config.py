"""The tiny graph's engine args, as the config tests and the live realtime tests build them."""

from __future__ import annotations

from pathlib import Path

import yaml


def tiny_args() -> dict:
    return yaml.safe_load((GRAPHS / "tiny_omni.yaml").read_text())["applications"][0]["args"]


GRAPHS = Path(__file__).resolve().parent.parent / "graphs"
