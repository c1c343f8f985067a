// The Horizon playground: one user turn per POST /playground/run, its events streamed back (SSE).
// Everything the model or a tool produced goes into the page as text (textContent), never as HTML.
"use strict";

const meta = (name) => document.querySelector(`meta[name="${name}"]`).content;
const $ = (id) => document.getElementById(id);
const state = { messages: [], system: null, running: false, apiKey: null };

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function setup() {
  $("model-name").textContent = meta("horizon-model");
  if (meta("horizon-auth") === "on") $("auth-box").hidden = false;
  for (const name of meta("horizon-tools").split(",").filter(Boolean)) {
    const label = el("label");
    const box = el("input");
    box.type = "checkbox";
    box.name = "tool";
    box.value = name;
    box.id = `tool-${name}`;
    label.append(box, ` ${name}`);
    $("tools").append(label);
  }
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("export").addEventListener("click", exportConversation);
  $("clear").addEventListener("click", () => { state.messages = []; $("log").replaceChildren(); });
  $("api-key").addEventListener("change", (e) => { state.apiKey = e.target.value || null; });
  $("message").focus();
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function send() {
  const text = $("message").value.trim();
  if (!text || state.running) return;
  let content = text;
  const file = $("image").files[0];
  if (file) content = [{ type: "text", text }, { type: "image_url", image_url: { url: await readImage(file) } }];
  const body = {
    messages: state.messages,
    content,
    system: $("system").value.trim() || null,
    tier: $("tier").value || null,
    tools: [...document.querySelectorAll('input[name="tool"]:checked')].map((b) => b.value),
    tool_choice: $("tool-choice").value,
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("json-mode").checked) {
    try { body.response_schema = JSON.parse($("schema").value); } catch (e) {
      showError(`the schema is not JSON: ${e.message}`); return;
    }
  }
  state.system = body.system;
  $("message").value = "";
  $("image").value = "";
  addUser(text, Boolean(file), body.tier);
  await run(body);
}

function addUser(text, image, tier) {
  const turn = el("div", "turn user");
  turn.append(el("div", "who", `you · thinking ${tier || "none"}`), el("div", "text", text));
  if (image) turn.append(el("div", "note", "(image attached)"));
  $("log").append(turn);
}

class Step {
  constructor(index) {
    this.node = el("div", "turn assistant");
    this.node.dataset.step = index;
    this.node.append(el("div", "who", `model · step ${index + 1}`));
    this.thinking = null;
    this.answer = null;
    this.calls = {};
    this.lastCall = null;
    $("log").append(this.node);
  }
  think(text) {
    if (!this.thinking) {
      const id = `thinking-${Date.now()}-${Math.random().toString(36).slice(2)}`;
      const toggle = el("button", "think-toggle", "Hide thinking");
      toggle.type = "button";
      toggle.setAttribute("aria-expanded", "true");
      toggle.setAttribute("aria-controls", id);
      toggle.setAttribute("aria-label", "Show or hide the model's thinking");
      this.thinking = el("div", "thinking");
      this.thinking.id = id;
      toggle.addEventListener("click", () => {
        const open = toggle.getAttribute("aria-expanded") === "true";
        toggle.setAttribute("aria-expanded", String(!open));
        toggle.textContent = open ? "Show thinking" : "Hide thinking";
        this.thinking.hidden = open;
      });
      this.node.append(toggle, this.thinking);
    }
    this.thinking.textContent += text;
  }
  text(text) {
    if (!this.answer) { this.answer = el("div", "answer"); this.node.append(this.answer); }
    this.answer.textContent += text;
  }
  call(id, name) {
    const box = el("div", "call");
    box.dataset.id = id;
    const args = el("code", "args");
    box.append(el("span", "name", `${name}(`), args, el("span", "", ")"));
    this.node.append(box);
    this.calls[id] = box;
    this.lastCall = args;
  }
  args(text) { if (this.lastCall) this.lastCall.textContent += text; }
  usage(u, ttft) {
    const ms = ttft == null ? "–" : `${Math.round(ttft * 1000)} ms`;
    this.node.append(el("div", "usage", `prompt ${u.prompt_tokens} · cached ${u.cached_tokens} · thinking ` +
      `${u.reasoning_tokens} · output ${u.completion_tokens} · first token ${ms}`));
  }
}

function addResult(data) {
  const box = el("div", data.is_error ? "result error" : "result");
  box.append(el("div", "who", `${data.name} →`), el("pre", "", data.content));
  const call = document.querySelector(`.call[data-id="${CSS.escape(data.id)}"]`);
  (call ? call.parentNode : $("log")).insertBefore(box, call ? call.nextSibling : null);
}

function showError(message) {
  $("log").append(el("div", "turn error", message));
}

async function run(body) {
  state.running = true;
  $("status").textContent = "generating…";
  const headers = { "content-type": "application/json", "x-horizon-csrf": meta("horizon-csrf") };
  if (state.apiKey) headers.authorization = `Bearer ${state.apiKey}`;
  let step = null;
  try {
    const response = await fetch("/playground/run", { method: "POST", headers, body: JSON.stringify(body) });
    if (!response.ok) {
      const err = await response.json().catch(() => ({ error: { message: response.statusText } }));
      showError(`${response.status}: ${err.error ? err.error.message : JSON.stringify(err)}`);
      return;
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const kind = /^event: (.*)$/m.exec(frame)[1];
        const data = JSON.parse(/^data: (.*)$/m.exec(frame)[1]);
        step = handle(kind, data, step);
      }
    }
  } catch (e) {
    showError(`the request failed: ${e.message}`);
  } finally {
    state.running = false;
    $("status").textContent = "";
  }
}

function handle(kind, data, step) {
  switch (kind) {
    case "step": return new Step(data.step);
    case "thinking": step.think(data.text); break;
    case "text": step.text(data.text); break;
    case "tool_call": step.call(data.id, data.name); break;
    case "tool_args": step.args(data.text); break;
    case "turn": step.usage(data.usage, data.ttft_s); break;
    case "tool_result": addResult(data); break;
    case "done":
      state.stop = data.stop_reason;
      if (data.error) showError(data.error);
      break;
    case "history":  // the conversation as the API returned it: the next turn sends it back unchanged
      state.messages = data.messages;
      $("log").append(el("div", "note done", `done: ${state.stop}`));
      break;
    case "error": showError(data.message); break;
    default: break;
  }
  return step;
}

function exportConversation() {
  const messages = (state.system ? [{ role: "system", content: state.system }] : []).concat(state.messages);
  const text = JSON.stringify({ model: meta("horizon-model"), messages }, null, 2);
  const out = $("export-json");
  out.textContent = text;
  out.hidden = false;
  const link = el("a", "", "download");
  link.href = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  link.download = "conversation.json";
  link.click();
}

document.addEventListener("DOMContentLoaded", setup);
