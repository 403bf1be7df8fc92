// The omni_serve playground: talks to the graph that serves it through the public HTTP API only
// (/v1/models, /v1/chat/completions streamed, /v1/audio/speech, /v1/images/generations and /edits,
// /v1/videos, /health, /stages, and the /v1/realtime websocket for the Talk panel).
// Audio is played with Web Audio as chunks arrive, each chunk scheduled to start where the previous ends.
// Every panel reports what it measured on its <output> element, as text and as data-* attributes.

const BASE = new URL("../", location.href); // the page lives at <app>/playground/
const PCM_RATE = 24000; // raw `pcm` audio is 16-bit mono at 24 kHz (the API's documented shape)
const FIRST_CHUNK_LEAD_S = 0.05; // scheduling slack for the first chunk only
const POLL_MS = 2000;
const JOB_POLL_MS = 500; // a video job's status, while it runs
const $ = (selector) => document.querySelector(selector);

let card = null; // the /v1/models card
let history = []; // the chat so far, as OpenAI messages
let attachments = []; // content parts for the next user message

// ---- HTTP -----------------------------------------------------------------------------------

async function api(path, init = {}) {
  // A FormData body (multipart) sets its own content type, with its boundary.
  const json = init.body !== undefined && !(init.body instanceof FormData);
  const headers = { ...(json ? { "content-type": "application/json" } : {}), ...init.headers };
  const key = $("#api-key").value.trim();
  if (key) headers.authorization = `Bearer ${key}`;
  const response = await fetch(new URL(path, BASE), { ...init, headers });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error?.message ?? message;
    } catch { /* not JSON: keep the status line */ }
    throw new Error(`${path}: ${message}`);
  }
  return response;
}

/** The `data:` payloads of a server-sent-event stream, one per event. */
async function* sse(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

const base64Bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));

function readDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

// ---- audio ----------------------------------------------------------------------------------

function pcm16Buffer(ctx, bytes, rate) {
  const samples = new Int16Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
  const buffer = ctx.createBuffer(1, samples.length, rate);
  const channel = buffer.getChannelData(0);
  for (let i = 0; i < samples.length; i++) channel[i] = samples[i] / 32768;
  return buffer;
}

/** Plays chunks in arrival order without gaps: each starts where the previous one ends. */
class AudioPlayer {
  constructor() {
    this.ctx = null;
    this.reset();
  }

  reset() {
    this.queue = Promise.resolve();
    this.nextTime = 0;
    this.chunks = 0;
    this.samples = 0;
    this.seconds = 0;
    this.gaps = 0; // chunks that arrived after the audio before them had finished playing
    this.sources = [];
  }

  /** Barge-in: stop what is playing and scheduled, and drop what is still being decoded. */
  interrupt() {
    this.sources.forEach((source) => source.stop());
    const counts = { chunks: this.chunks, samples: this.samples, seconds: this.seconds, gaps: this.gaps };
    this.reset();
    Object.assign(this, counts); // what was played stays counted
  }

  /** Call from a click handler: browsers start audio only after a user gesture. */
  start() {
    this.ctx ??= new AudioContext({ sampleRate: PCM_RATE });
    return this.ctx.resume();
  }

  /** One self-contained chunk: a file (wav, flac, mp3, ...) or raw 16-bit PCM. Decoded and played in order. */
  push(bytes, format, rate = PCM_RATE) {
    this.queue = this.queue.then(async () => {
      const buffer = format === "pcm"
        ? pcm16Buffer(this.ctx, bytes, rate)
        : await this.ctx.decodeAudioData(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
      this.schedule(buffer);
    });
    return this.queue;
  }

  schedule(buffer) {
    const now = this.ctx.currentTime;
    if (this.chunks > 0 && this.nextTime < now) this.gaps += 1;
    const start = Math.max(this.nextTime, now + (this.chunks === 0 ? FIRST_CHUNK_LEAD_S : 0));
    const source = this.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.ctx.destination);
    source.start(start);
    this.sources.push(source);
    source.onended = () => { this.sources = this.sources.filter((s) => s !== source); };
    this.nextTime = start + buffer.duration;
    this.chunks += 1;
    this.samples += buffer.length;
    this.seconds += buffer.duration;
  }
}

const player = new AudioPlayer();

/** A 16-bit mono WAV file (microphone recordings are sent as `input_audio` in wav). */
function wavFile(samples, rate) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (offset, s) => [...s].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF"); view.setUint32(4, 36 + samples.length * 2, true); text(8, "WAVEfmt ");
  view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, rate, true); view.setUint32(28, rate * 2, true); view.setUint16(32, 2, true);
  view.setUint16(34, 16, true); text(36, "data"); view.setUint32(40, samples.length * 2, true);
  samples.forEach((s, i) => view.setInt16(44 + i * 2, Math.max(-1, Math.min(1, s)) * 32767, true));
  return new Blob([view], { type: "audio/wav" });
}

// ---- what each panel measured ---------------------------------------------------------------

class Report {
  constructor(output) {
    this.output = output;
    this.started = performance.now();
    this.marks = {};
    Object.keys(output.dataset).forEach((k) => delete output.dataset[k]);
    this.set({ state: "busy" }, "…");
  }

  mark(name) {
    this.marks[name] ??= performance.now() - this.started;
  }

  set(data, text) {
    Object.assign(this.output.dataset, data);
    if (text !== undefined) this.output.textContent = text;
  }

  done(extra = {}, parts = []) {
    const total = performance.now() - this.started;
    const ms = (v) => (v < 1000 ? `${v.toFixed(0)} ms` : `${(v / 1000).toFixed(2)} s`);
    const text = [];
    if (this.marks.ttft !== undefined) text.push(`first text ${ms(this.marks.ttft)}`);
    if (this.marks.ttfa !== undefined) text.push(`first audio ${ms(this.marks.ttfa)}`);
    text.push(`total ${ms(total)}`, ...parts);
    const data = { state: "done", totalMs: total.toFixed(1), ...extra };
    if (this.marks.ttft !== undefined) data.ttftMs = this.marks.ttft.toFixed(1);
    if (this.marks.ttfa !== undefined) data.ttfaMs = this.marks.ttfa.toFixed(1);
    this.set(data, text.join(" · "));
  }

  fail(error) {
    this.set({ state: "error", error: error.message }, `error: ${error.message}`);
  }
}

function audioReport() {
  const gaps = player.gaps ? ` (${player.gaps} late)` : "";
  return [
    { audioChunks: player.chunks, audioSamples: player.samples, audioSeconds: player.seconds.toFixed(4), gaps: player.gaps },
    player.chunks ? [`audio ${player.seconds.toFixed(2)} s in ${player.chunks} chunks${gaps}`] : [],
  ];
}

function showError(error) {
  $("#error").textContent = error ? error.message : "";
  $("#error").hidden = !error;
}

async function busy(button, work) {
  button.disabled = true;
  showError(null);
  try {
    await work();
  } catch (error) {
    showError(error);
  } finally {
    button.disabled = false;
  }
}

// ---- talk: a /v1/realtime voice session ------------------------------------------------------

let talk = null; // the session in progress: {ws, stop}

function pcm16Base64(samples) {
  const bytes = new Uint8Array(samples.length * 2);
  const view = new DataView(bytes.buffer);
  samples.forEach((s, i) => view.setInt16(i * 2, Math.max(-1, Math.min(1, s)) * 32767, true));
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

/** Microphone -> pcm16 24 kHz appends; the server's VAD ends each turn; audio deltas play as they arrive. */
async function toggleTalk() {
  if (talk) {
    talk.stop();
    return;
  }
  await player.start(); // the click is the gesture that lets audio play
  player.reset();
  const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
  const url = new URL("v1/realtime", BASE);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.searchParams.set("model", card.id);
  const key = $("#api-key").value.trim(); // browsers cannot set headers on a websocket: OpenAI's subprotocol
  const ws = new WebSocket(url, key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"]);
  const report = new Report($("#talk-metrics"));
  let replies = 0;
  let line = null; // the assistant's transcript line being written
  // The context runs at 24 kHz, so the browser resamples the microphone to the session's rate.
  const mic = player.ctx.createMediaStreamSource(stream);
  const tap = player.ctx.createScriptProcessor(2048, 1, 1);
  tap.onaudioprocess = (event) => {
    if (ws.readyState !== WebSocket.OPEN) return;
    const audio = pcm16Base64(event.inputBuffer.getChannelData(0));
    ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio }));
  };
  const stop = () => {
    tap.disconnect();
    mic.disconnect();
    stream.getTracks().forEach((track) => track.stop());
    ws.close();
    talk = null;
    $("#talk-button").textContent = "● Start talking";
  };
  ws.onopen = () => {
    mic.connect(tap);
    tap.connect(player.ctx.destination); // a ScriptProcessor runs only when connected; it outputs silence
  };
  ws.onmessage = (message) => {
    const event = JSON.parse(message.data);
    if (event.type === "input_audio_buffer.speech_started") {
      player.interrupt(); // barge-in: the server cancels the response, the page stops playing it
      report.set({ heard: "speech" });
    } else if (event.type === "response.created") {
      line = document.createElement("div");
      line.className = "message assistant";
      $("#talk-transcript").append(line);
    } else if (event.type === "response.output_audio_transcript.delta" || event.type === "response.output_text.delta") {
      report.mark("ttft");
      if (line) line.textContent += event.delta;
    } else if (event.type === "response.output_audio.delta") {
      report.mark("ttfa");
      player.push(base64Bytes(event.delta), "pcm");
    } else if (event.type === "response.done") {
      replies += 1;
      player.queue.then(() => {
        const [data, parts] = audioReport();
        report.done({ ...data, replies, status: event.response.status }, [`${replies} replies`, ...parts]);
      });
    } else if (event.type === "error") {
      showError(new Error(event.error.message));
    }
  };
  ws.onclose = (event) => {
    if (event.code !== 1000 && event.code !== 1005) showError(new Error(`session closed: ${event.code} ${event.reason}`));
    if (talk) stop();
  };
  talk = { ws, stop };
  $("#talk-button").textContent = "■ Stop";
}

// ---- chat -----------------------------------------------------------------------------------

function addMessage(role, text, notes = []) {
  const item = document.createElement("div");
  item.className = `message ${role}`;
  const body = document.createElement("p");
  body.textContent = text;
  item.append(body, ...notes.map((note) => Object.assign(document.createElement("small"), { textContent: note })));
  $("#messages").append(item);
  item.scrollIntoView({ block: "end" });
  return { item, body };
}

function addImage(parent, src, alt) {
  const img = Object.assign(document.createElement("img"), { src, alt });
  parent.append(img);
  return img;
}

const speaking = () => !$("#speak-option").hidden && $("#speak").checked;
const voice = () => ($("#voice-select").hidden ? $("#voice-text").value.trim() : $("#voice-select").value) || undefined;

/** The tools box as the request's `tools` (undefined when empty); bad JSON is an error naming the box. */
function tools() {
  const text = $("#tools-json").value.trim();
  if (!text) return undefined;
  let parsed;
  try {
    parsed = JSON.parse(text);
  } catch (error) {
    throw new Error(`tools: not JSON (${error.message})`);
  }
  return Array.isArray(parsed) ? parsed : [parsed];
}

/** A tool call of the reply as it streams in: its name and arguments, and a box for its result. */
function showToolCall(reply, call) {
  call.element ??= Object.assign(document.createElement("div"), { className: "tool-call" });
  const code = Object.assign(document.createElement("code"), {
    textContent: `${call.function.name}(${call.function.arguments})`,
  });
  call.result ??= Object.assign(document.createElement("input"), { className: "tool-result", placeholder: "its result" });
  call.element.replaceChildren(code, call.result);
  Object.assign(call.element.dataset, { id: call.id ?? "", name: call.function.name, arguments: call.function.arguments });
  if (!call.element.isConnected) reply.item.append(call.element);
}

/** The user's turn (or, after a reply that called tools, the results typed for its calls), then the reply. */
async function sendChat() {
  const text = $("#prompt").value.trim();
  const pending = [...document.querySelectorAll(".tool-call.awaiting")];
  const turnStart = history.length;
  if (pending.length) {
    for (const element of pending) {
      history.push({ role: "tool", tool_call_id: element.dataset.id, content: element.querySelector("input").value });
      addMessage("tool", element.querySelector("input").value, [`result of ${element.dataset.name}`]);
      element.classList.remove("awaiting");
    }
  } else if (!text && !attachments.length) {
    throw new Error("say something first");
  }
  if (text || attachments.length) {
    const content = attachments.length ? [{ type: "text", text }, ...attachments.map((a) => a.part)] : text;
    addMessage("user", text, attachments.map((a) => `attached: ${a.name}`));
    history.push({ role: "user", content });
  }
  $("#prompt").value = "";
  attachments = [];
  $("#attachments").textContent = "";

  const format = $("#chat-format").value;
  const body = {
    model: card.id, messages: history, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("#max-tokens").value) || undefined,
    modalities: speaking() ? ["text", "audio"] : ["text"],
  };
  if (speaking()) body.audio = { voice: voice(), format };
  const offered = tools();
  if (offered) Object.assign(body, { tools: offered, tool_choice: $("#tool-choice").value });
  const reply = addMessage("assistant", "");
  const report = new Report($("#chat-metrics"));
  player.reset();
  await player.start();
  let answer = "";
  let finished = false;
  let usage = null;
  let finish = null;
  const calls = []; // the reply's tool calls, by index, as their pieces stream in
  try {
    const response = await api("v1/chat/completions", { method: "POST", body: JSON.stringify(body) });
    for await (const data of sse(response)) {
      if (data === "[DONE]") {
        finished = true;
        break;
      }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      usage = chunk.usage ?? usage;
      finish = chunk.choices?.[0]?.finish_reason ?? finish;
      const delta = chunk.choices?.[0]?.delta ?? {};
      if (typeof delta.content === "string" && delta.content) {
        report.mark("ttft");
        answer += delta.content;
        reply.body.textContent = answer;
      } else if (Array.isArray(delta.content)) {
        for (const part of delta.content) if (part.type === "image_url") addImage(reply.item, part.image_url.url, "image");
      }
      for (const piece of delta.tool_calls ?? []) {
        report.mark("ttft");
        const call = (calls[piece.index] ??= { id: null, type: "function", function: { name: "", arguments: "" } });
        call.id = piece.id ?? call.id;
        call.function.name += piece.function?.name ?? "";
        call.function.arguments += piece.function?.arguments ?? "";
        showToolCall(reply, call);
      }
      if (delta.audio?.data) {
        report.mark("ttfa");
        player.push(base64Bytes(delta.audio.data), format);
      }
    }
    // A stream that stops before [DONE] was cut short (the server reports errors in-band): never a reply.
    if (!finished) throw new Error("the stream ended before [DONE]: the reply is incomplete");
    await player.queue;
    const made = calls.filter(Boolean);
    const turn = { role: "assistant", content: answer || null };
    if (made.length) turn.tool_calls = made.map(({ id, type, function: f }) => ({ id, type, function: f }));
    history.push(turn);
    made.forEach((call) => call.element.classList.add("awaiting")); // the next send carries their results
    const [data, parts] = audioReport();
    const tokens = usage ? [`${usage.completion_tokens} tokens`] : [];
    const called = made.length ? [`${made.length} tool call(s): type each result, then Send`] : [];
    report.done({ ...data, text: answer, toolCalls: made.length, finishReason: finish ?? "" }, [...tokens, ...called, ...parts]);
  } catch (error) {
    history.length = turnStart; // the turn that got no answer
    pending.forEach((element) => element.classList.add("awaiting"));
    if (answer || calls.length) reply.item.classList.add("failed");
    else reply.item.remove();
    report.fail(error);
    throw error;
  }
}

async function attach(file) {
  const url = await readDataURL(file);
  const kind = file.type.split("/")[0];
  let part;
  if (kind === "image") part = { type: "image_url", image_url: { url } };
  else if (kind === "video") part = { type: "video_url", video_url: { url } };
  else if (kind === "audio") {
    const format = /wav/.test(file.type) ? "wav" : /mpeg|mp3/.test(file.type) ? "mp3" : file.name.split(".").pop();
    part = { type: "input_audio", input_audio: { data: url.slice(url.indexOf(",") + 1), format } };
  } else throw new Error(`cannot send ${file.name} (${file.type || "unknown type"}): images, audio or video only`);
  attachments.push({ name: file.name, part });
  $("#attachments").textContent = attachments.map((a) => a.name).join(", ");
}

let recorder = null;
const RECORD_SLICE_MS = 250;

async function toggleRecording() {
  if (recorder) {
    recorder.stop();
    return;
  }
  const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  const pieces = [];
  recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (event) => {
    pieces.push(event.data);
    $("#record").textContent = `■ Stop (${((pieces.length * RECORD_SLICE_MS) / 1000).toFixed(2)} s)`;
  };
  recorder.onstop = () => busy($("#record"), async () => {
    stream.getTracks().forEach((track) => track.stop());
    recorder = null;
    $("#record").textContent = "● Record";
    await player.start();
    const decoded = await player.ctx.decodeAudioData(await new Blob(pieces).arrayBuffer());
    const wav = wavFile(decoded.getChannelData(0), decoded.sampleRate);
    await attach(new File([wav], `recording-${attachments.length + 1}.wav`, { type: "audio/wav" }));
  });
  recorder.start(RECORD_SLICE_MS);
  $("#record").textContent = "■ Stop";
}

// ---- speech ---------------------------------------------------------------------------------

/** Where the samples of a streamed WAV start, and its sample rate (the server streams an open-ended header). */
function wavHeader(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  for (let offset = 12; offset + 8 <= bytes.length; ) {
    const id = String.fromCharCode(...bytes.subarray(offset, offset + 4));
    if (id === "data") return { end: offset + 8, rate: view.getUint32(24, true) };
    offset += 8 + view.getUint32(offset + 4, true);
  }
  return null; // not all of the header is here yet
}

async function speak() {
  const format = $("#speech-format").value;
  const report = new Report($("#speech-metrics"));
  player.reset();
  await player.start();
  try {
    const response = await api("v1/audio/speech", {
      method: "POST",
      body: JSON.stringify({ model: card.id, input: $("#speech-input").value, voice: voice(), response_format: format }),
    });
    const streamed = format === "wav" || format === "pcm"; // 16-bit PCM as it is decoded, after any header
    const reader = response.body.getReader();
    const parts = [];
    let pending = new Uint8Array(0);
    let rate = format === "pcm" ? PCM_RATE : null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      parts.push(value);
      if (!streamed) continue;
      let bytes = new Uint8Array(pending.length + value.length);
      bytes.set(pending);
      bytes.set(value, pending.length);
      if (rate === null) {
        const header = wavHeader(bytes);
        if (!header) {
          pending = bytes;
          continue;
        }
        rate = header.rate;
        bytes = bytes.subarray(header.end);
      }
      const whole = bytes.length - (bytes.length % 2);
      if (whole) {
        report.mark("ttfa");
        player.push(bytes.slice(0, whole), "pcm", rate);
      }
      pending = bytes.slice(whole);
    }
    const file = new Blob(parts, { type: response.headers.get("content-type") ?? "" });
    if (!streamed) {
      report.mark("ttfa");
      player.push(new Uint8Array(await file.arrayBuffer()), format);
    }
    await player.queue;
    Object.assign($("#speech-download"), { href: URL.createObjectURL(file), download: `speech.${format}`, hidden: false });
    const [data, text] = audioReport();
    report.done({ ...data, bytes: file.size }, text);
  } catch (error) {
    report.fail(error);
    throw error;
  }
}

// ---- images ---------------------------------------------------------------------------------

function imageOptions() {
  const options = { model: card.id, prompt: $("#image-prompt").value, size: $("#image-size").value,
    n: Number($("#image-n").value) || 1, response_format: "b64_json" };
  if ($("#image-steps").value !== "") options.num_inference_steps = Number($("#image-steps").value);
  if ($("#image-seed").value !== "") options.seed = Number($("#image-seed").value);
  return options;
}

/** Show the images of an ImagesResponse in the gallery and report them. */
async function showImages(response, report, prompt) {
  const images = (await response.json()).data.map((item) => {
    const img = Object.assign(document.createElement("img"), { src: `data:image/png;base64,${item.b64_json}`, alt: prompt });
    $("#gallery").prepend(img);
    return img;
  });
  await Promise.all(images.map((img) => img.decode()));
  const size = images.length ? `${images[0].naturalWidth}×${images[0].naturalHeight}` : "";
  report.done({ images: images.length, size }, [`${images.length} image(s) ${size}`]);
}

async function generate() {
  const report = new Report($("#image-metrics"));
  const body = imageOptions();
  try {
    const response = await api("v1/images/generations", { method: "POST", body: JSON.stringify(body) });
    await showImages(response, report, body.prompt);
  } catch (error) {
    report.fail(error);
    throw error;
  }
}

/** OpenAI's image edit: multipart `image` (and `mask`: transparent where to repaint) with the form's fields. */
async function edit() {
  const report = new Report($("#image-metrics"));
  const options = imageOptions();
  const form = new FormData();
  Object.entries(options).forEach(([key, value]) => form.append(key, String(value)));
  form.append("image", $("#edit-image").files[0]);
  if ($("#edit-mask").files.length) form.append("mask", $("#edit-mask").files[0]);
  try {
    const response = await api("v1/images/edits", { method: "POST", body: form });
    await showImages(response, report, options.prompt);
  } catch (error) {
    report.fail(error);
    throw error;
  }
}

// ---- videos: an OpenAI video job, polled, then its MP4 played --------------------------------

async function makeVideo() {
  const report = new Report($("#video-metrics"));
  const body = { model: card.id, prompt: $("#video-prompt").value };
  if ($("#video-size").value.trim()) body.size = $("#video-size").value.trim();
  const numbers = { "#video-frames": "num_frames", "#video-fps": "fps", "#video-steps": "num_inference_steps", "#video-seed": "seed" };
  Object.entries(numbers).forEach(([id, field]) => { if ($(id).value !== "") body[field] = Number($(id).value); });
  try {
    let job = await (await api("v1/videos", { method: "POST", body: JSON.stringify(body) })).json();
    const statuses = [job.status];
    while (job.status === "queued" || job.status === "in_progress") {
      report.set({ status: job.status, progress: job.progress }, `${job.status.replace("_", " ")} ${job.progress}% · ${job.id}`);
      await new Promise((resolve) => setTimeout(resolve, JOB_POLL_MS));
      job = await (await api(`v1/videos/${job.id}`)).json();
      if (statuses.at(-1) !== job.status) statuses.push(job.status);
    }
    if (job.status !== "completed") throw new Error(`video ${job.id} ${job.status}: ${job.error?.message ?? ""}`);
    const mp4 = await (await api(`v1/videos/${job.id}/content`)).blob();
    const video = Object.assign(document.createElement("video"), {
      src: URL.createObjectURL(mp4), controls: true, muted: true, loop: true, title: body.prompt,
    });
    video.dataset.job = job.id;
    $("#video-gallery").prepend(video);
    await new Promise((resolve, reject) => {
      video.addEventListener("loadeddata", resolve, { once: true });
      video.addEventListener("error", () => reject(new Error(`the browser cannot play ${job.id}.mp4`)), { once: true });
    });
    const size = `${video.videoWidth}×${video.videoHeight}`;
    report.done(
      { id: job.id, statuses: statuses.join(" "), bytes: mp4.size, size, duration: video.duration.toFixed(3), seconds: job.seconds },
      [`${size} · ${job.seconds} s · ${(mp4.size / 1024).toFixed(1)} KiB`],
    );
  } catch (error) {
    report.fail(error);
    throw error;
  }
}

// ---- the graph: model card, health, stages ---------------------------------------------------

function fillSelect(select, values) {
  select.replaceChildren(...values.map((v) => Object.assign(document.createElement("option"), { value: v, textContent: v })));
}

async function loadCard() {
  card = (await (await api("v1/models")).json()).data[0];
  const info = await (await api("playground/info")).json();
  const outputs = new Set(card.modalities ?? []);
  const inputs = new Set(card.input_modalities ?? []);
  $("#model").textContent = card.id;
  document.title = `${card.id} · omni_serve playground`;
  $("#chat").hidden = !outputs.has("text");
  $("#speak-option").hidden = !outputs.has("audio");
  document.querySelectorAll(".audio-only").forEach((el) => { el.hidden = !outputs.has("audio"); });
  $("#speech").hidden = !outputs.has("audio");
  $("#talk").hidden = !outputs.has("audio") || !inputs.has("audio") || !navigator.mediaDevices;
  $("#images").hidden = !outputs.has("image");
  // Editing: an image graph whose entry stage takes images (OpenAI's /v1/images/edits).
  $("#edit").hidden = !outputs.has("image") || !inputs.has("image");
  $("#videos").hidden = !outputs.has("video");
  const voices = (card.voices ?? []).map((v) => (typeof v === "string" ? v : v.id ?? v.name));
  $("#voice-select").hidden = voices.length === 0;
  $("#voice-text").hidden = voices.length > 0;
  fillSelect($("#voice-select"), voices);
  fillSelect($("#chat-format"), info.chat_audio_formats);
  fillSelect($("#speech-format"), info.speech_formats);
  // Omni input: offered only where the card says the graph takes it.
  const accept = ["image", "audio", "video"].filter((m) => inputs.has(m));
  $("#attach").hidden = accept.length === 0;
  $("#attach-file").accept = accept.map((m) => `${m}/*`).join(",");
  $("#record").hidden = !inputs.has("audio") || !navigator.mediaDevices;
  document.body.dataset.card = card.id; // the forms now match the graph
}

async function pollStatus() {
  try {
    const response = await fetch(new URL("health", BASE));
    const health = await response.json().catch(() => ({}));
    $("#health").textContent = response.ok ? "healthy" : `unavailable${health.error ? `: ${health.error.message}` : ""}`;
    $("#health").className = `badge ${response.ok ? "ok" : "down"}`;
    const report = await (await api("stages")).json();
    $("#stages tbody").replaceChildren(...report.stages.map((stage) => {
      const row = document.createElement("tr");
      const starting = stage.starting ? ` (+${stage.starting} starting)` : "";
      let probe = health.stages?.[stage.name]; // /health's own word on the stage, when it gives one
      if (probe && typeof probe === "object") probe = probe.status ?? JSON.stringify(probe);
      const status = probe ? `${stage.status} · ${probe}` : stage.status;
      const cells = [stage.name, status, `${stage.running}/${stage.target}${starting}`, stage.message];
      row.replaceChildren(...cells.map((c) => Object.assign(document.createElement("td"), { textContent: c ?? "" })));
      row.dataset.stage = stage.name;
      row.dataset.running = stage.running;
      return row;
    }));
  } catch (error) {
    $("#health").textContent = `unreachable: ${error.message}`;
    $("#health").className = "badge down";
  } finally {
    setTimeout(pollStatus, POLL_MS);
  }
}

let connectRetry = null;

// The card can fail while the graph starts (routes not propagated, stages not up): keep asking until
// it loads, so a page opened early still ends up with the graph's forms.
async function connect() {
  clearTimeout(connectRetry);
  try {
    await loadCard();
    showError(null);
  } catch (error) {
    showError(error);
    connectRetry = setTimeout(connect, POLL_MS);
  }
}

function main() {
  $("#api-key").value = sessionStorage.getItem("omni_serve.api_key") ?? "";
  $("#api-key").addEventListener("change", () => {
    sessionStorage.setItem("omni_serve.api_key", $("#api-key").value.trim());
    connect();
  });
  $("#chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    busy($("#send"), sendChat);
  });
  $("#clear").addEventListener("click", () => {
    history = [];
    attachments = [];
    $("#messages").replaceChildren();
  });
  $("#attach-file").addEventListener("change", (event) => busy($("#send"), async () => {
    for (const file of event.target.files) await attach(file);
    event.target.value = "";
  }));
  $("#record").addEventListener("click", () => toggleRecording().catch(showError));
  $("#talk-button").addEventListener("click", () => toggleTalk().catch(showError));
  $("#speech-form").addEventListener("submit", (event) => {
    event.preventDefault();
    busy($("#speak-button"), speak);
  });
  $("#image-form").addEventListener("submit", (event) => {
    event.preventDefault();
    busy($("#generate"), generate);
  });
  $("#edit-image").addEventListener("change", () => { $("#edit-button").disabled = !$("#edit-image").files.length; });
  $("#edit-button").addEventListener("click", () => {
    if ($("#image-form").reportValidity()) busy($("#edit-button"), edit).then(() => {
      $("#edit-button").disabled = !$("#edit-image").files.length;
    });
  });
  $("#video-form").addEventListener("submit", (event) => {
    event.preventDefault();
    busy($("#video-button"), makeVideo);
  });
  connect();
  pollStatus();
}

main();
