"""Every served family runs every graph property (tests/graph_properties.py) on its deployed graph, every TTS family
every TTS property (tests/tts_properties.py), and every pipeline docs/models.md marks as served end to end in CI is
such a family (no Ray here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.families import FAMILIES
from tests.tts_properties import SPEAKERS

ROOT = Path(__file__).resolve().parent.parent


def test_every_family_module_checks_every_graph_property() -> None:
    for family in FAMILIES:
        source = (ROOT / "tests" / f"{family.module}.py").read_text()
        assert "graph_properties.PROPERTIES" in source and f'BY_NAME["{family.name}"]' in source, family.name
        graph = yaml.safe_load((ROOT / "graphs" / family.graph).read_text())["applications"][0]["args"]
        pipelines = {s["engine_args"].get("pipeline") for s in graph["stages"]}
        assert pipelines == {family.pipeline}, family.name  # None for a family outside vLLM-Omni


def test_every_tts_family_module_checks_every_tts_property() -> None:
    speaking = {family.name for family in FAMILIES if family.route == "/v1/audio/speech"}
    assert speaking and set(SPEAKERS) == speaking
    for family in FAMILIES:
        if family.name in speaking:
            source = (ROOT / "tests" / f"{family.module}.py").read_text()
            assert "tts_properties.PROPERTIES" in source, family.name
            assert f'tts_properties.SPEAKERS["{family.name}"]' in source, family.name


def test_every_pipeline_served_end_to_end_is_a_family() -> None:
    doc = (ROOT / "docs" / "models.md").read_text()
    served = set(re.findall(r"^\| `([^`]+)` \| [^|]+ \| \*\*served end to end in CI\*\*", doc, re.MULTILINE))
    assert served and served <= {family.pipeline for family in FAMILIES}
