"""The playground in a real browser: Playwright, Chromium with a fake microphone, a page per test."""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests import deps

TOOLS = "make test installs it (.ci/install-debian-tools.sh)"


CHROMIUM = shutil.which("chromium")


SHOTS = Path(os.environ.get("OMNI_SERVE_SCREENSHOTS", "/tmp/omni_serve-screenshots"))


DONE = '[data-state="done"], [data-state="error"]'


TIMEOUT_MS = 120_000


FAKE_MIC = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    """One Playwright for the module: its sync API runs an event loop while it is open, so a test cannot
    open a second one beside it (tests that need other browser flags launch from this one)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if sync_playwright is None or CHROMIUM is None:
        deps.missing("the playwright package" if sync_playwright is None else "chromium", TOOLS)
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(driver) -> Iterator[Any]:
    # The fake devices give the microphone a test tone; no autoplay flag: audio starts from the click.
    browser = driver.chromium.launch(executable_path=CHROMIUM, args=FAKE_MIC)
    yield browser
    browser.close()


@pytest.fixture
def page(browser, request) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SHOTS / f"{request.node.name}.png", full_page=True)
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def open_playground(page, base_url: str, stages: list[str]) -> None:
    page.goto(f"{base_url}/")
    assert page.url == f"{base_url}/playground/"
    for stage in stages:  # the stage report shows each stage with a running replica
        page.wait_for_selector(f'#stages tr[data-stage="{stage}"]:not([data-running="0"])', timeout=TIMEOUT_MS)
    page.wait_for_selector("#health.ok", timeout=TIMEOUT_MS)
    # The card comes from /v1/models, which asks the stages for voices: it can land after /health.
    page.wait_for_selector("body[data-card]", timeout=TIMEOUT_MS)


def report(page, selector: str) -> dict[str, str]:
    page.wait_for_selector(f"{selector}:is({DONE})", timeout=TIMEOUT_MS)
    data = page.eval_on_selector(selector, "e => ({...e.dataset, shown: e.textContent})")
    assert data["state"] == "done", data
    return data


def shot(locator) -> np.ndarray:
    """What the element looks like on screen, as RGB pixels."""
    assert locator.is_visible()
    return np.asarray(Image.open(io.BytesIO(locator.screenshot())).convert("RGB")).astype(np.int16)
