// dllm-jax playground: streams completions with the `dllm.canvas` extension and draws the
// answer filling in. Only the public API is used: POST /v1/chat/completions or
// /v1/completions with "stream": true, and GET /v1/models for the model's name.
"use strict";

const MAX_SETTINGS = 3;
// The page's presets: "denoise" (the first load) commits one token per step, so that the
// denoising is visible (threshold 1: only candidates the model is sure of commit together, and
// always the most confident one); "fast" leaves the method its defaults.
const PRESETS = { denoise: { threshold: "1" }, fast: { threshold: "" } };
// Methods that commit by a confidence threshold (the others, llada and dream, by a fixed schedule).
const THRESHOLD_METHODS = new Set(["flash_cache", "flash_cache+verify", "fast_dllm"]);
// Compare mode starts with these settings (fields of the request's "dllm" object).
// Compare mode gives setting i the server's i-th method; with fewer methods, these thresholds.
const COMPARE_THRESHOLDS = ["0.9", "0.7", "0.5"];
// Colour stops of the step scale (viridis: ordered in lightness, readable by colour-blind eyes).
const STEP_COLOURS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"];
const REPLAY_FRAME_MS = 180;

// ---------------------------------------------------------------------------------------------
// Server-Sent Events over fetch (POST bodies rule out EventSource).

/** Yields the data of each event of an SSE byte stream (a Response body). */
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  const takeLine = (line) => {
    if (line === "") {
      const event = data.length ? data.join("\n") : null;
      data = [];
      return event;
    }
    if (line.startsWith(":")) return null; // comment (keep-alive)
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") data.push(value);
    return null;
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      // A trailing "\r" may be the first half of "\r\n": keep it for the next read.
      const heldCR = buffer.endsWith("\r");
      const lines = (heldCR ? buffer.slice(0, -1) : buffer).split(/\r\n|\r|\n/);
      buffer = lines.pop() + (heldCR ? "\r" : "");
      for (const line of lines) {
        const event = takeLine(line);
        if (event !== null) yield event;
      }
    }
    const last = takeLine(buffer.replace(/\r$/, "")) ?? takeLine("");
    if (last !== null) yield last;
  } finally {
    reader.releaseLock();
  }
}

/** The message of an OpenAI-shaped error response, or the status line. */
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`;
}

/** POSTs one streamed request and calls onChunk with each parsed chunk until [DONE]. */
async function streamCompletion({ path, body, apiKey, signal, onChunk }) {
  const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), signal });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const data of sseEvents(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
    onChunk(chunk);
  }
  throw new Error("the stream ended before [DONE]");
}

// ---------------------------------------------------------------------------------------------
// One request's denoising history.

/**
 * The canvas of one answer as the stream builds it.
 * cells[p] is null while position p is masked, else {tokenId, text, verified, step, frame};
 * frames[k] is the k-th step that committed something: {step, commits, seconds}.
 */
class CanvasHistory {
  constructor() {
    this.cells = [];
    this.frames = [];
    this.eosPosition = null;
    this.text = "";
    this.finishReason = null;
    this.usage = null;
    this.serverStats = null;
    this.startedAt = performance.now();
    this.finishedAt = null;
  }

  get genLength() {
    return this.cells.length;
  }

  /** Denoising steps so far: the server's final count once it sent one. */
  get steps() {
    if (this.serverStats && this.serverStats.steps !== undefined) return this.serverStats.steps;
    return this.frames.length ? this.frames[this.frames.length - 1].step : 0;
  }

  /** Tokens of the answer after `frameCount` committing steps: committed positions before the end. */
  answerTokens(frameCount = this.frames.length) {
    let count = 0;
    this.cells.forEach((cell, position) => {
      if (cell && cell.frame < frameCount && (this.eosPosition === null || position < this.eosPosition)) count += 1;
    });
    return count;
  }

  seconds() {
    return ((this.finishedAt ?? performance.now()) - this.startedAt) / 1000;
  }

  /** Applies one stream chunk; returns the positions it committed. */
  apply(chunk) {
    const choice = chunk.choices && chunk.choices[0];
    if (choice) {
      const piece = choice.text ?? (choice.delta && choice.delta.content) ?? "";
      this.text += piece;
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
    }
    if (chunk.usage) this.usage = chunk.usage;
    const canvas = chunk.dllm;
    if (!canvas) return [];
    if (canvas.steps !== undefined) this.serverStats = canvas;
    if (canvas.gen_length && this.cells.length !== canvas.gen_length) {
      this.cells = Array.from({ length: canvas.gen_length }, (_, p) => this.cells[p] ?? null);
    }
    if (canvas.eos_position !== undefined && canvas.eos_position !== null) this.eosPosition = canvas.eos_position;
    const commits = canvas.commits || [];
    if (!commits.length) return [];
    const frame = this.frames.length;
    this.frames.push({ step: canvas.step, commits, seconds: this.seconds() });
    for (const commit of commits) {
      this.cells[commit.position] = {
        tokenId: commit.token_id,
        text: commit.text,
        verified: Boolean(commit.verified),
        step: canvas.step,
        frame,
      };
    }
    return commits.map((c) => c.position);
  }
}

// ---------------------------------------------------------------------------------------------
// Drawing.

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

/** The colour of a cell committed at `step` on a scale from `first` to `last` step. */
function stepColour(step, first, last) {
  const t = last > first ? (step - first) / (last - first) : 0;
  const x = t * (STEP_COLOURS.length - 1);
  const i = Math.min(Math.floor(x), STEP_COLOURS.length - 2);
  const a = hexToRgb(STEP_COLOURS[i]);
  const b = hexToRgb(STEP_COLOURS[i + 1]);
  const f = x - i;
  const rgb = a.map((v, k) => Math.round(v + (b[k] - v) * f));
  const luminance = (0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]) / 255;
  return { background: `rgb(${rgb.join(",")})`, foreground: luminance > 0.55 ? "#111" : "#fff" };
}

/** A token piece as a cell shows it: visible whitespace, EOS named. */
function cellLabel(text, isEos) {
  if (isEos) return "EOS";
  if (text === undefined || text === null || text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

/** One answer panel: counters, the canvas grid, replay slider and final text. */
class Panel {
  constructor(container, title, summary, request) {
    const fragment = document.getElementById("panel-template").content.cloneNode(true);
    this.root = fragment.querySelector("[data-panel]");
    this.parts = {};
    for (const node of this.root.querySelectorAll("[data-role]")) this.parts[node.dataset.role] = node;
    this.parts.title.textContent = title;
    this.parts["settings-summary"].textContent = summary;
    this.parts.request.textContent = `POST ${request.path}\n${JSON.stringify(request.body, null, 2)}`;
    this.root.dataset.path = request.path;
    this.root.dataset.request = JSON.stringify(request.body);
    this.history = new CanvasHistory();
    this.cellNodes = [];
    this.playTimer = null;
    this.parts.replay.addEventListener("input", () => this.showFrames(Number(this.parts.replay.value)));
    this.parts.play.addEventListener("click", () => this.togglePlay());
    container.appendChild(fragment);
  }

  setState(state) {
    this.root.dataset.state = state;
  }

  fail(message) {
    this.setState("error");
    this.parts.error.textContent = message;
    this.parts.error.hidden = false;
  }

  /** Makes one grey cell per position once the first chunk says how many there are. */
  ensureCells() {
    const grid = this.parts.canvas;
    while (this.cellNodes.length < this.history.genLength) {
      const cell = document.createElement("span");
      cell.className = "cell masked";
      cell.setAttribute("role", "listitem");
      cell.dataset.cell = "";
      cell.dataset.position = String(this.cellNodes.length);
      cell.dataset.state = "masked";
      grid.appendChild(cell);
      this.cellNodes.push(cell);
    }
  }

  /** Draws the canvas as it stood after `frameCount` committing steps; `fresh` = just committed. */
  drawCanvas(frameCount, fresh = new Set()) {
    this.ensureCells();
    const history = this.history;
    const frames = history.frames;
    const firstStep = frames.length ? frames[0].step : 0;
    // colours span the steps so far while streaming, all the steps once finished (stable in replay)
    const scaleEnd = history.finishedAt === null ? frameCount : frames.length;
    const lastStep = scaleEnd ? frames[scaleEnd - 1].step : firstStep;
    // the end of the answer, once the frames drawn have committed it
    const eos = history.eosPosition;
    const eosCell = eos === null ? null : history.cells[eos];
    const end = eosCell && eosCell.frame < frameCount ? eos : null;
    history.cells.forEach((cell, position) => {
      const node = this.cellNodes[position];
      const visible = cell !== null && cell.frame < frameCount;
      const isEos = visible && end !== null && position >= end && cell.tokenId === eosCell.tokenId;
      const isPadding = end !== null && position > end;
      node.classList.toggle("masked", !visible);
      node.classList.toggle("verified", visible && cell.verified);
      node.classList.toggle("fresh", visible && fresh.has(position));
      node.classList.toggle("eos", isEos);
      node.classList.toggle("padding", isPadding);
      node.dataset.state = visible ? "filled" : "masked";
      if (visible) {
        const colour = stepColour(cell.step, firstStep, lastStep);
        node.style.background = colour.background;
        node.style.color = colour.foreground;
        node.textContent = cellLabel(cell.text, isEos);
        node.dataset.step = String(cell.step);
        node.dataset.tokenId = String(cell.tokenId);
        node.dataset.verified = String(cell.verified);
        const how = cell.verified ? ", draft accepted by Flash-Verify" : "";
        node.title = `position ${position}: ${JSON.stringify(cell.text)} (token ${cell.tokenId}), step ${cell.step}${how}`;
        node.setAttribute("aria-label", `position ${position}: ${cellLabel(cell.text, isEos)}, step ${cell.step}${how}`);
      } else {
        node.style.background = "";
        node.style.color = "";
        node.textContent = "";
        delete node.dataset.step;
        delete node.dataset.tokenId;
        delete node.dataset.verified;
        node.title = `position ${position}: masked`;
        node.setAttribute("aria-label", `position ${position}: masked${isPadding ? " (after the end)" : ""}`);
      }
    });
    this.parts["first-step"].textContent = String(firstStep);
    this.parts["last-step"].textContent = String(lastStep);
  }

  drawCounters() {
    const history = this.history;
    const steps = history.steps;
    const tokens = history.usage ? history.usage.completion_tokens : history.answerTokens();
    const last = history.frames[history.frames.length - 1];
    const seconds = history.seconds();
    this.parts.steps.textContent = String(steps);
    this.parts["step-commits"].textContent = last ? String(last.commits.length) : "0";
    this.parts.tokens.textContent = String(tokens);
    // the server's count once it sent one (reference tokens per step, docs/counters.md), else the page's own
    const serverPerStep = history.serverStats && history.serverStats.tokens_per_step;
    const perStep = typeof serverPerStep === "number" ? serverPerStep : steps ? tokens / steps : null;
    this.parts["tokens-per-step"].textContent = perStep === null ? "–" : perStep.toFixed(2);
    this.parts["tokens-per-second"].textContent = seconds > 0 && tokens ? (tokens / seconds).toFixed(1) : "–";
    const passes = history.serverStats && history.serverStats.forward_passes;
    this.parts["forward-passes"].textContent = passes === undefined || passes === null ? "–" : String(passes);
    this.parts["final-text"].textContent = history.text;
    this.parts["finish-reason"].textContent = history.finishReason ? `(finish: ${history.finishReason})` : "";
  }

  /** Applies a stream chunk and redraws what it changed. */
  update(chunk) {
    const committed = this.history.apply(chunk);
    this.drawCanvas(this.history.frames.length, new Set(committed));
    this.drawCounters();
  }

  finish() {
    this.history.finishedAt = performance.now();
    this.drawCanvas(this.history.frames.length);
    this.drawCounters();
    const frames = this.history.frames.length;
    this.parts.replay.max = String(frames);
    this.parts.replay.value = String(frames);
    this.parts["replay-box"].hidden = frames === 0;
    this.describeReplay(frames);
    this.setState("done");
  }

  describeReplay(frameCount) {
    const frames = this.history.frames;
    const frame = frameCount ? frames[frameCount - 1] : { step: 0, seconds: 0 };
    const tokens = this.history.answerTokens(frameCount);
    const text = `step ${frame.step} of ${this.history.steps}, ${frame.seconds.toFixed(2)} s: ${tokens} tokens`;
    this.parts["replay-position"].textContent = text;
    this.parts.replay.setAttribute("aria-valuetext", text);
  }

  /** Replay: shows the canvas after `frameCount` committing steps. */
  showFrames(frameCount) {
    const frames = this.history.frames;
    const fresh = frameCount ? new Set(frames[frameCount - 1].commits.map((c) => c.position)) : new Set();
    this.drawCanvas(frameCount, fresh);
    this.describeReplay(frameCount);
  }

  togglePlay() {
    if (this.playTimer !== null) {
      clearInterval(this.playTimer);
      this.playTimer = null;
      this.parts.play.textContent = "▶";
      return;
    }
    const slider = this.parts.replay;
    if (Number(slider.value) >= Number(slider.max)) slider.value = "0";
    this.parts.play.textContent = "❚❚";
    this.playTimer = setInterval(() => {
      const next = Number(slider.value) + 1;
      slider.value = String(next);
      this.showFrames(next);
      if (next >= Number(slider.max)) this.togglePlay();
    }, REPLAY_FRAME_MS);
    this.showFrames(Number(slider.value));
  }
}

// ---------------------------------------------------------------------------------------------
// The form.

const settingsBox = document.getElementById("settings");
const compareToggle = document.getElementById("compare");
const addSettingButton = document.getElementById("add-setting");
let activeRun = null;
let modelReady = null;
let serverMethods = []; // the methods the server runs (GET /v1/models), the default first
let methodsKnown = false;

/** The starting values of compare setting i: the server's i-th method, else a threshold. */
function comparePreset(i) {
  if (serverMethods.length > 1) return serverMethods[i] ? { method: serverMethods[i] } : {};
  return { threshold: COMPARE_THRESHOLDS[i] };
}

function fillMethodOptions(select) {
  const chosen = select.value;
  select.replaceChildren(new Option(serverMethods.length ? `server default (${serverMethods[0]})` : "server default", ""));
  for (const method of serverMethods) select.appendChild(new Option(method, method));
  select.value = chosen;
}

/** The method a setting runs: its own choice, else the server's default. */
function settingMethod(fieldset) {
  return fieldset.querySelector('[data-field="method"]').value || serverMethods[0] || "";
}

/** Applies the page's preset to one setting (its threshold, where its method takes one). */
function applyPreset(fieldset) {
  const preset = PRESETS[document.getElementById("preset").value];
  const method = settingMethod(fieldset);
  const takesThreshold = !method || THRESHOLD_METHODS.has(method);
  fieldset.querySelector('[data-field="threshold"]').value = takesThreshold ? preset.threshold : "";
}

function addSetting(preset = {}) {
  const fragment = document.getElementById("setting-template").content.cloneNode(true);
  const fieldset = fragment.querySelector("[data-setting]");
  const methodSelect = fieldset.querySelector('[data-field="method"]');
  fillMethodOptions(methodSelect);
  if (preset.method) methodSelect.value = preset.method;
  applyPreset(fieldset);
  for (const [field, value] of Object.entries(preset)) {
    const input = fieldset.querySelector(`[data-field="${field}"]`);
    if (input) input.value = value;
  }
  methodSelect.addEventListener("change", () => applyPreset(fieldset));
  fieldset.querySelector('[data-role="remove-setting"]').addEventListener("click", () => {
    fieldset.remove();
    relabelSettings();
  });
  settingsBox.appendChild(fragment);
  relabelSettings();
}

function relabelSettings() {
  const fieldsets = [...settingsBox.querySelectorAll("[data-setting]")];
  const compare = compareToggle.checked;
  fieldsets.forEach((fieldset, i) => {
    fieldset.querySelector('[data-role="setting-label"]').textContent = String.fromCharCode(65 + i);
    fieldset.querySelector('[data-role="remove-setting"]').hidden = !compare || fieldsets.length <= 2;
  });
  addSettingButton.hidden = !compare || fieldsets.length >= MAX_SETTINGS;
}

function setCompare(compare) {
  const fieldsets = [...settingsBox.querySelectorAll("[data-setting]")];
  if (compare) {
    const first = fieldsets[0].querySelector('[data-field="method"]');
    if (!first.value && serverMethods.length > 1) first.value = serverMethods[0];
    else if (serverMethods.length <= 1 && !fieldsets[0].querySelector('[data-field="threshold"]').value) {
      fieldsets[0].querySelector('[data-field="threshold"]').value = COMPARE_THRESHOLDS[0];
    }
    const count = Math.min(MAX_SETTINGS, Math.max(2, serverMethods.length));
    for (let i = fieldsets.length; i < count; i++) addSetting(comparePreset(i));
  } else {
    fieldsets.slice(1).forEach((fieldset) => fieldset.remove());
  }
  relabelSettings();
}

/** The "dllm" extension object of one setting: only the fields the user set. */
function readSetting(fieldset) {
  const extension = { canvas: true };
  const value = (field) => fieldset.querySelector(`[data-field="${field}"]`).value.trim();
  if (value("method")) extension.method = value("method");
  if (value("threshold")) extension.threshold = Number(value("threshold"));
  if (value("gamma")) extension.gamma = Number(value("gamma"));
  return extension;
}

function describeSetting(extension) {
  const parts = [];
  parts.push(extension.method ?? "server default");
  if (extension.threshold !== undefined) parts.push(`threshold ${extension.threshold}`);
  if (extension.gamma !== undefined) parts.push(`gamma ${extension.gamma}`);
  return parts.join(" · ");
}

/** The request body and endpoint path for the form's prompt and one setting. */
function buildRequest(extension) {
  const prompt = document.getElementById("prompt").value;
  const endpoint = document.getElementById("endpoint").value;
  // include_usage: the last chunk carries usage and the server's step and pass counts
  const body = { model: window.dllmModel || undefined, stream: true, stream_options: { include_usage: true } };
  if (endpoint === "chat") body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  const number = (id) => document.getElementById(id).value.trim();
  if (number("max-tokens")) body.max_tokens = Number(number("max-tokens"));
  if (number("temperature")) body.temperature = Number(number("temperature"));
  if (number("seed")) body.seed = Number(number("seed"));
  body.dllm = extension;
  return { path: endpoint === "chat" ? "/v1/chat/completions" : "/v1/completions", body };
}

async function runPanel(panel, request, apiKey, signal) {
  panel.setState("running");
  try {
    await streamCompletion({ ...request, apiKey, signal, onChunk: (chunk) => panel.update(chunk) });
    panel.finish();
  } catch (error) {
    panel.history.finishedAt = performance.now();
    panel.drawCounters();
    if (signal.aborted) panel.setState("stopped");
    else panel.fail(error.message);
  }
}

async function run(event) {
  event.preventDefault();
  const status = document.getElementById("form-status");
  if (!document.getElementById("prompt").value.trim()) {
    status.textContent = "Write a prompt first.";
    return;
  }
  await modelReady;
  const panelsBox = document.getElementById("panels");
  panelsBox.replaceChildren();
  const controller = new AbortController();
  activeRun = controller;
  const apiKey = document.getElementById("api-key").value.trim();
  const fieldsets = [...settingsBox.querySelectorAll("[data-setting]")];
  const jobs = fieldsets.map((fieldset, i) => {
    const extension = readSetting(fieldset);
    const request = buildRequest(extension);
    const title = fieldsets.length > 1 ? `Setting ${String.fromCharCode(65 + i)}` : "Answer";
    const panel = new Panel(panelsBox, title, describeSetting(extension), request);
    return runPanel(panel, request, apiKey, controller.signal);
  });
  panelsBox.dataset.count = String(jobs.length);
  document.getElementById("run").disabled = true;
  document.getElementById("stop").disabled = false;
  status.textContent = jobs.length > 1 ? `Running ${jobs.length} settings…` : "Running…";
  await Promise.all(jobs);
  if (activeRun === controller) activeRun = null;
  document.getElementById("run").disabled = false;
  document.getElementById("stop").disabled = true;
  status.textContent = "Done.";
}

async function showModel() {
  const label = document.getElementById("model-name");
  const apiKey = document.getElementById("api-key").value.trim();
  try {
    const response = await fetch("/v1/models", { headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {} });
    if (!response.ok) throw new Error(await errorMessage(response));
    const models = await response.json();
    const card = models.data && models.data[0];
    window.dllmModel = card ? card.id : undefined;
    serverMethods = card && Array.isArray(card.methods) ? card.methods : [];
    for (const select of document.querySelectorAll('[data-field="method"]')) fillMethodOptions(select);
    if (!methodsKnown) {
      // the first time the methods are known: the preset, now for the server's default method
      for (const fieldset of settingsBox.querySelectorAll("[data-setting]")) applyPreset(fieldset);
      methodsKnown = serverMethods.length > 0;
    }
    label.textContent = window.dllmModel ?? "unknown";
  } catch (error) {
    label.textContent = `unavailable (${error.message})`;
  }
}

function main() {
  addSetting();
  compareToggle.addEventListener("change", async () => {
    await modelReady; // compare settings start from the server's methods
    setCompare(compareToggle.checked);
  });
  addSettingButton.addEventListener("click", () => addSetting(comparePreset(settingsBox.children.length)));
  document.getElementById("request-form").addEventListener("submit", run);
  document.getElementById("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) document.getElementById("request-form").requestSubmit();
  });
  document.getElementById("stop").addEventListener("click", () => activeRun && activeRun.abort());
  document.getElementById("preset").addEventListener("change", () => {
    for (const fieldset of settingsBox.querySelectorAll("[data-setting]")) applyPreset(fieldset);
  });
  document.getElementById("api-key").addEventListener("change", () => (modelReady = showModel()));
  modelReady = showModel();
}

main();
