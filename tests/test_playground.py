"""The playground in a real browser: Debian's chromium, driven by playwright, on the session's graphs.

What the page shows is checked against what the server sent, decoded here independently
(soundfile for audio, Pillow for images), and screenshots are checked for content.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf
from fastapi import FastAPI
from PIL import Image
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.testclient import TestClient

from omni_serve.api import playground
from omni_serve.api.openai.errors import http_exception_handler
from omni_serve.cli.launch import load_graph_file
from omni_serve.graph.config import load_graph
from tests.playground_browser import CHROMIUM, DONE, FAKE_MIC, SHOTS, TIMEOUT_MS, open_playground, report, shot
from tests.playground_browser import browser as browser
from tests.playground_browser import driver as driver
from tests.playground_browser import page as page

# ---- no browser: the routes, in-process ---------------------------------------------------------


def _client(playground_on: bool) -> TestClient:
    args = load_graph_file("tiny_image.yaml")["applications"][0]["args"]
    app = FastAPI()
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)  # as the ingress does
    playground.mount(app)
    playground.configure(load_graph({**args, "playground": playground_on}), lambda request: None)
    return TestClient(app)


def test_page_files_are_served_with_their_types() -> None:
    client = _client(True)
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/playground/"
    page = client.get("/playground/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="playground.js">' in page.text
    assert client.get("/playground/playground.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/playground/playground.css").headers["content-type"].startswith("text/css")
    assert client.get("/playground/../config.py").status_code == 404
    info = client.get("/playground/info").json()
    assert {"wav", "pcm", "flac"} <= set(info["chat_audio_formats"]) and "wav" in info["speech_formats"]


def test_graph_args_turn_the_playground_off() -> None:
    client = _client(False)
    for path in ("/", "/playground/", "/playground/playground.js", "/playground/info"):
        reply = client.get(path, follow_redirects=False)
        assert reply.status_code == 404, path
        assert "playground: false" in reply.json()["error"]["message"]


# ---- in the browser -------------------------------------------------------------------------------


def sse_events(body: bytes) -> list[Any]:
    events = [line[5:].strip() for line in body.decode().split("\n") if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_streams_text_and_plays_every_audio_chunk(tiny_omni, page) -> None:
    open_playground(page, tiny_omni.base_url, ["thinker", "talker", "code2wav"])
    assert page.is_visible("#speech") and page.is_hidden("#images")
    assert page.is_visible("#attach")  # the card lists the thinker's input_modalities: upload and record
    assert page.is_checked("#speak")
    page.fill("#prompt", "Say hello.")
    with page.expect_response("**/v1/chat/completions") as response:
        page.click("#send")
    data = report(page, "#chat-metrics")

    chunks = sse_events(response.value.body())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("modality") == "text")
    audio = [c["choices"][0]["delta"]["audio"]["data"] for c in chunks if c.get("modality") == "audio"]
    decoded = [sf.read(io.BytesIO(base64.b64decode(a)), dtype="float32") for a in audio]
    assert text and audio and all(rate == 24000 and samples.size for samples, rate in decoded)
    # The page decoded and scheduled every chunk the server sent, sample for sample.
    assert int(data["audioChunks"]) == len(audio)
    assert int(data["audioSamples"]) == sum(samples.size for samples, _ in decoded)
    assert 0 < float(data["ttftMs"]) <= float(data["totalMs"]) and 0 < float(data["ttfaMs"]) <= float(data["totalMs"])
    assert "first text" in data["shown"] and "first audio" in data["shown"]

    reply = page.locator(".message.assistant").last
    assert reply.inner_text() == text
    pixels = shot(reply)
    assert pixels.std() > 10  # text is drawn on the bubble, not an empty box

    # A second turn sends the whole conversation.
    page.uncheck("#speak")
    page.fill("#prompt", "And again.")
    with page.expect_request("**/v1/chat/completions") as second:
        page.click("#send")
    assert report(page, "#chat-metrics").get("audioChunks") == "0"
    body = json.loads(second.value.post_data)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == text and body["modalities"] == ["text"]


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    },
}


def test_chat_shows_tool_calls_and_sends_their_results(tiny_omni, page) -> None:
    """The tools box: the page offers them, shows the call as it streams (name, arguments) and sends the
    result typed for it back as a tool message, with the assistant's call before it in the history."""
    open_playground(page, tiny_omni.base_url, ["thinker", "talker", "code2wav"])
    page.uncheck("#speak")
    page.click("#tools-option summary")
    page.fill("#tools-json", json.dumps([TOOL]))
    page.select_option("#tool-choice", "required")  # forced: the tiny thinker's random weights call it
    page.fill("#max-tokens", "200")
    page.fill("#prompt", "The weather?")
    with page.expect_response("**/v1/chat/completions") as response:
        page.click("#send")
    data = report(page, "#chat-metrics")
    sent = json.loads(response.value.request.post_data)
    assert sent["tools"] == [TOOL] and sent["tool_choice"] == "required"
    chunks = sse_events(response.value.body())
    pieces = [p for c in chunks if c.get("choices") for p in c["choices"][0]["delta"].get("tool_calls") or []]
    arguments = "".join(p["function"].get("arguments") or "" for p in pieces)
    assert data["toolCalls"] == "1" and "tool call" in data["shown"]
    call = page.locator(".tool-call").last
    assert call.get_attribute("data-name") == "get_weather" and call.get_attribute("data-arguments") == arguments
    assert call.get_attribute("data-id") == pieces[0]["id"]
    assert call.inner_text().startswith(f"get_weather({arguments[:20]}")
    assert shot(call).std() > 10  # drawn, not an empty box

    # The result goes back as a tool message answering that call; the assistant's call precedes it.
    call.locator("input").fill("21 degrees")
    page.select_option("#tool-choice", "none")
    page.fill("#max-tokens", "4")
    with page.expect_request("**/v1/chat/completions") as second:
        page.click("#send")
    assert report(page, "#chat-metrics")["toolCalls"] == "0"
    body = json.loads(second.value.post_data)
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
    assert body["messages"][1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}
    assert body["messages"][2] == {"role": "tool", "tool_call_id": pieces[0]["id"], "content": "21 degrees"}
    assert page.locator(".message.tool").last.inner_text().startswith("21 degrees")


def test_speech_streams_into_the_player(tiny_omni, page) -> None:
    open_playground(page, tiny_omni.base_url, ["thinker", "talker", "code2wav"])
    page.fill("#speech-input", "Hello from the playground.")
    page.select_option("#speech-format", "wav")
    with page.expect_response("**/v1/audio/speech") as response:
        page.click("#speak-button")
    data = report(page, "#speech-metrics")
    body = response.value.body()
    assert body[:4] == b"RIFF" and body[36:40] == b"data"
    samples = (len(body) - 44) // 2  # the stream's 16-bit samples after its open-ended header
    assert samples > 0 and int(data["audioSamples"]) == samples and int(data["bytes"]) == len(body)
    assert page.is_visible("#speech-download")


def _talk(tiny_omni, driver, mic: Path) -> tuple[list[dict[str, Any]], dict[str, str], list[str]]:
    """One Talk session in a browser whose microphone plays ``mic`` once: the websocket's events as
    the page received them, the page's metrics once a reply is done, and its transcript lines."""
    browser = driver.chromium.launch(
        executable_path=CHROMIUM, args=[*FAKE_MIC, f"--use-file-for-fake-audio-capture={mic}%noloop"]
    )
    try:
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        events: list[dict[str, Any]] = []
        page.on("websocket", lambda ws: ws.on("framereceived", lambda frame: events.append(json.loads(frame))))
        open_playground(page, tiny_omni.base_url, ["thinker", "talker", "code2wav"])
        assert page.is_visible("#talk")
        page.click("#talk-button")
        data = report(page, "#talk-metrics")
        lines = page.locator("#talk-transcript .message").all_inner_texts()
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SHOTS / "talk.png", full_page=True)
        assert not errors, f"JavaScript errors in the page: {errors}"
    finally:
        browser.close()
    return events, data, lines


def test_talk_hears_the_microphone_and_plays_the_reply(tiny_omni, driver, tmp_path) -> None:
    """The Talk panel over /v1/realtime: Chromium's fake microphone speaks a WAV (espeak-ng), the
    server's VAD ends the turn, and the page plays every audio delta the websocket carried.

    The page's turns take the graph's default sampling, and the random-weight talker may sample its
    codec EOS at its first step (1 reply in 366, tests/audio.py): a completed reply with a transcript
    and no audio. Then, and only then, the session is held once more (CI saw it once: the talker's
    call took 100 ms and code2wav was never called). A reply that loses its audio any other way fails.
    """
    from tests.audio import spoken

    mic = tmp_path / "mic.wav"
    speech = np.frombuffer(spoken("Hello, can you hear me?", rate=48000), "<i2")
    sf.write(mic, np.concatenate([np.zeros(24000, "<i2"), speech, np.zeros(96000, "<i2")]), 48000, subtype="PCM_16")
    for attempt in range(2):
        events, data, lines = _talk(tiny_omni, driver, mic)
        kinds = [e["type"] for e in events]
        assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.committed" in kinds
        first_done = kinds.index("response.done")
        done = events[first_done]["response"]
        before = events[:first_done]
        deltas = [base64.b64decode(e["delta"]) for e in before if e["type"] == "response.output_audio.delta"]
        transcript = "".join(e["delta"] for e in before if e["type"] == "response.output_audio_transcript.delta")
        if deltas or attempt or not (done["status"] == "completed" and transcript):
            break
    assert deltas and transcript, (done, kinds)
    # The page scheduled every sample the server sent, and shows the reply's transcript.
    assert int(data["audioSamples"]) == sum(len(d) // 2 for d in deltas) and int(data["audioChunks"]) == len(deltas)
    assert data["replies"] == "1" and "1 replies" in data["shown"]
    assert lines and lines[0] == transcript


def test_omni_input_parts_once_the_card_lists_input_modalities(tiny_omni, page, tmp_path) -> None:
    """The upload UI appears only for graphs that take media; it sends OpenAI content parts."""

    def card_with_inputs(route) -> None:
        models = route.fetch().json()
        models["data"][0]["input_modalities"] = ["text", "image", "audio"]
        route.fulfill(json=models)

    page.route("**/v1/models", card_with_inputs)
    open_playground(page, tiny_omni.base_url, ["thinker"])
    page.wait_for_selector("#attach", state="visible", timeout=TIMEOUT_MS)  # shown once the card has loaded
    assert page.is_visible("#record")
    assert page.get_attribute("#attach-file", "accept") == "image/*,audio/*"
    png = tmp_path / "dot.png"
    Image.new("RGB", (8, 8), (200, 30, 30)).save(png)
    page.set_input_files("#attach-file", str(png))
    page.wait_for_selector("#attachments:has-text('dot.png')")
    page.click("#record")  # the fake microphone's tone; once half a second is in, stop: it is attached as WAV
    page.wait_for_selector("#record:has-text('0.50 s')", timeout=TIMEOUT_MS)
    page.click("#record")
    page.wait_for_selector("#attachments:has-text('recording-2.wav')", timeout=TIMEOUT_MS)

    page.fill("#prompt", "What is in the picture?")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    page.wait_for_selector(f"#chat-metrics:is({DONE})", timeout=TIMEOUT_MS)
    text, image, recording = json.loads(sent.value.post_data)["messages"][0]["content"]
    assert text == {"type": "text", "text": "What is in the picture?"}
    assert image["type"] == "image_url"
    assert image["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    assert recording["type"] == "input_audio" and recording["input_audio"]["format"] == "wav"
    wav, rate = sf.read(io.BytesIO(base64.b64decode(recording["input_audio"]["data"])))
    assert rate > 0 and wav.ndim == 1
    real_card = httpx.get(f"{tiny_omni.base_url}/v1/models", timeout=30).json()["data"][0]
    assert {"image", "audio"} <= set(real_card["input_modalities"])  # the tiny thinker takes both: a real reply
    assert page.get_attribute("#chat-metrics", "data-state") == "done"
