"use strict";
// The playground: chat and completions against this server's /v1 API, streamed as Server-Sent Events.
// Model output reaches the page only through textContent or renderMarkdown (which escapes it first).

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "llmserve.apiKey";
const state = { model: null, messages: [], controller: null };

// ---- the API: the stored key on every call; a 401 asks for a key and retries --------------------

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY_STORAGE);
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

function askKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason;
  $("key-input").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        const key = $("key-input").value.trim();
        const saved = dialog.returnValue === "save" && key !== "";
        if (saved) localStorage.setItem(KEY_STORAGE, key);
        resolve(saved);
      },
      { once: true },
    );
    dialog.showModal();
  });
}

async function api(path, init = {}) {
  for (;;) {
    const response = await fetch(`v1${path}`, { ...init, headers: headers() });
    if (response.status !== 401) return response;
    const reason = localStorage.getItem(KEY_STORAGE)
      ? "The server refused the stored API key. Enter the right one."
      : "This server needs an API key.";
    if (!(await askKey(reason))) return response;
  }
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function loadModel() {
  try {
    const response = await api("/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
  } catch (error) {
    $("model").textContent = `no model: ${error.message}`;
  }
}

// ---- one request: sampling controls in, streamed text and live figures out --------------------

function samplingBody() {
  const body = { model: state.model };
  for (const name of ["temperature", "top_p"]) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  for (const name of ["top_k", "max_tokens", "seed"]) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = parseInt(value, 10);
  }
  const stop = $("stop").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  const schema = $("json-schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (error) {
      throw new Error(`The JSON schema is not JSON: ${error.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed } };
  }
  return body;
}

function formatStats(s) {
  const parts = [];
  if (s.first !== null) parts.push(`TTFT ${Math.round(s.first - s.start)} ms`);
  const output = s.usage?.completion_tokens ?? s.chunks;
  if (s.first !== null && output > 1 && s.last > s.first) {
    parts.push(`${(((output - 1) * 1000) / (s.last - s.first)).toFixed(1)} tok/s`);
  }
  if (s.usage) parts.push(`${s.usage.prompt_tokens} prompt tokens`);
  parts.push(`${output} output tokens`);
  if (s.finish) parts.push(s.finish);
  return parts.join(" · ");
}

// Streams `body` to `path`; `view.append(text)` gets each piece, `view.stats(line)` the figures.
// Returns the whole text, or what arrived before Stop.
async function stream(path, body, view) {
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const s = { start: performance.now(), first: null, last: null, chunks: 0, usage: null, finish: "" };
  let text = "";
  try {
    const request = { ...body, stream: true, stream_options: { include_usage: true, continuous_usage_stats: true } };
    const response = await api(path, { method: "POST", body: JSON.stringify(request), signal: controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) s.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta ? choice.delta.content : choice.text;
        if (piece) {
          s.last = performance.now();
          s.first ??= s.last;
          s.chunks += 1;
          text += piece;
          view.append(piece);
        }
        if (choice.finish_reason) s.finish = `finished: ${choice.finish_reason}`;
      }
      view.stats(formatStats(s));
    }
  } catch (error) {
    if (error.name === "AbortError") s.finish = "stopped";
    else view.error(error.message);
  } finally {
    state.controller = null;
    setBusy(false);
    view.stats(formatStats(s));
  }
  return text;
}

function setBusy(busy) {
  for (const id of ["send", "run", "clear"]) $(id).disabled = busy;
  for (const id of ["stop-chat", "stop-complete"]) $(id).disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

function stop() {
  state.controller?.abort();
}

// ---- chat -----------------------------------------------------------------------------------

function button(label, onClick, name = "") {
  const element = document.createElement("button");
  element.type = "button";
  element.className = `quiet small ${name}`;
  element.textContent = label;
  element.addEventListener("click", onClick);
  return element;
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  element.append(content);
  if (role === "user") content.textContent = text;
  $("messages").append(element);
  return element;
}

// An assistant answer: rendered Markdown (at most once a frame while it streams), figures, buttons.
function answerView(element) {
  const content = element.querySelector(".content");
  const stats = document.createElement("div");
  stats.className = "stats";
  element.append(stats);
  let raw = "";
  let pending = false;
  const render = () => {
    pending = false;
    content.innerHTML = renderMarkdown(raw);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  return {
    append(piece) {
      raw += piece;
      if (!pending) {
        pending = true;
        requestAnimationFrame(render);
      }
    },
    stats(line) {
      stats.textContent = line;
    },
    error(message) {
      const note = document.createElement("div");
      note.className = "error";
      note.textContent = message;
      element.append(note);
    },
    text: () => raw,
    finish() {
      render();
      const tools = document.createElement("div");
      tools.className = "tools";
      tools.append(button("Copy", () => copyText(raw)), button("Regenerate", regenerate, "regenerate"));
      element.append(tools);
    },
  };
}

async function answer() {
  const element = addMessage("assistant", "");
  const view = answerView(element);
  let body;
  try {
    body = samplingBody();
  } catch (error) {
    view.error(error.message);
    return;
  }
  const system = $("system-prompt").value.trim();
  body.messages = [...(system ? [{ role: "system", content: system }] : []), ...state.messages];
  const text = await stream("/chat/completions", body, view);
  view.finish();
  if (text) state.messages.push({ role: "assistant", content: text });
}

// The clipboard API exists only in secure contexts (https, localhost); elsewhere, the old way.
async function copyText(text) {
  if (navigator.clipboard) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea");
  area.value = text;
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

async function send(event) {
  event.preventDefault();
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || state.controller) return;
  input.value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  await answer();
}

// Answers the last user message again: the last answer leaves the history and the page.
async function regenerate() {
  if (state.controller) return;
  if (state.messages.at(-1)?.role === "assistant") state.messages.pop();
  const last = $("messages").lastElementChild;
  if (last?.classList.contains("assistant")) last.remove();
  await answer();
}

function clearChat() {
  state.messages = [];
  $("messages").replaceChildren();
}

// ---- completions ----------------------------------------------------------------------------

async function complete() {
  if (state.controller) return;
  const prompt = $("prompt").value;
  const output = $("completion").querySelector(".output-text");
  $("completion").querySelector(".prompt-text").textContent = prompt;
  output.textContent = "";
  $("completion").classList.remove("failed");
  const view = {
    append: (piece) => output.append(piece),
    stats: (line) => ($("completion-stats").textContent = line),
    error: (message) => {
      output.textContent = message;
      $("completion").classList.add("failed");
    },
  };
  let body;
  try {
    body = samplingBody();
  } catch (error) {
    view.error(error.message);
    return;
  }
  await stream("/completions", { ...body, prompt }, view);
}

// ---- the page -------------------------------------------------------------------------------

function showPanel(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    const active = tab.dataset.panel === name;
    tab.setAttribute("aria-selected", String(active));
    $(tab.dataset.panel).hidden = !active;
  }
  document.body.dataset.panel = name;
}

function init() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showPanel(tab.dataset.panel));
  }
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("stop-chat").addEventListener("click", stop);
  $("stop-complete").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  $("run").addEventListener("click", complete);
  $("key-button").addEventListener("click", async () => {
    if (await askKey("The API key this page sends (kept in this browser's storage).")) loadModel();
  });
  showPanel("chat");
  loadModel();
}

init();
