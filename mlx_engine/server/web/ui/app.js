// The chat page: conversations kept in the browser, streamed answers from
// /v1/chat/completions with the engine's own statistics under each answer,
// a model picker over /v1/models with the host's load and unload routes.
// Everything the model writes is rendered by markdown.js (DOM nodes, textContent).

import { copyText, renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "mlx-engine.api-key"; // sessionStorage: this tab only

const state = {
  conversations: [],
  current: null,
  models: [],
  running: null, // {controller, conversation, message} while an answer streams
  attachments: [], // data URIs waiting to be sent
};

// -- HTTP ----------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers() });
  if (response.status === 401) {
    await askKey("The server needs an API key.");
    return api(path, options);
  }
  if (!response.ok) throw new HttpError(response.status, await errorText(response));
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

/** Show the key dialog; resolves once a key that the server accepts is kept. */
function askKey(reason) {
  const dialog = $("key-dialog");
  $("key-error").textContent = reason || "";
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
  return new Promise((resolve) => {
    const form = $("key-form");
    const submit = async (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      const check = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` } });
      if (check.status === 401) {
        $("key-error").textContent = "The server refused that key.";
        return;
      }
      sessionStorage.setItem(KEY_STORAGE, key);
      form.removeEventListener("submit", submit);
      dialog.close();
      resolve();
    };
    form.addEventListener("submit", submit);
  });
}

// -- models --------------------------------------------------------------------------------

async function refreshModels() {
  try {
    const body = await (await api("/v1/models")).json();
    state.models = (body.data || []).sort((a, b) => a.id.localeCompare(b.id));
  } catch (err) {
    notice(`could not list the models: ${err.message}`);
    return;
  }
  const conv = current();
  if (conv && !conv.model) conv.model = defaultModel();
  renderModels();
}

function defaultModel() {
  const loaded = state.models.find((m) => m.state === "loaded");
  return (loaded || state.models[0] || {}).id || null;
}

function selectedModel() {
  return state.models.find((m) => m.id === current()?.model) || null;
}

function renderModels() {
  const select = $("model");
  select.replaceChildren();
  for (const m of state.models) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = `${m.id} (${m.state.replace("_", " ")})`;
    option.dataset.state = m.state;
    select.appendChild(option);
  }
  const model = selectedModel();
  if (model) select.value = model.id;
  const action = $("model-action");
  action.textContent = model?.state === "loaded" ? "Unload" : "Load";
  action.disabled = !model || model.state === "loading" || model.state === "unloading";
  action.setAttribute("aria-label", `${action.textContent} ${model?.id || "model"}`);
  const draft = model?.mlx_engine?.draft;
  const draftOption = $("decoding").querySelector('option[value="draft"]');
  draftOption.textContent = draft ? `draft model (${draft})` : "draft model";
  draftOption.disabled = model?.state === "loaded" && !draft;
  $("model-state").textContent = model ? modelLine(model) : "no model";
}

function modelLine(m) {
  const e = m.mlx_engine || {};
  const parts = [m.state.replace("_", " ")];
  if (e.memory_bytes) parts.push(`${(e.memory_bytes / 2 ** 20).toFixed(0)} MiB`);
  if (e.draft) parts.push(`draft ${e.draft}`);
  if (e.running) parts.push(`${e.running} running`);
  if (e.last_error) parts.push(`last error: ${e.last_error}`);
  return parts.join(" · ");
}

async function loadOrUnload() {
  const model = selectedModel();
  if (!model) return;
  const unload = model.state === "loaded";
  $("model-action").disabled = true;
  $("model-state").textContent = unload ? "unloading…" : "loading…";
  try {
    const path = `/v1/mlx_engine/models/${unload ? "unload" : "load"}`;
    await api(path, { method: "POST", body: JSON.stringify({ model: model.id }) });
  } catch (err) {
    notice(`${unload ? "unload" : "load"} of ${model.id} failed: ${err.message}`);
  }
  await refreshModels();
}

// -- conversations -------------------------------------------------------------------------

function current() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function persist() {
  const err = store.save(state);
  if (err) notice(err);
}

function selectConversation(id) {
  state.current = id;
  persist();
  renderAll();
  document.body.classList.remove("show-sidebar");
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
}

function newChat() {
  const prev = current();
  const conv = store.newConversation(prev?.model || defaultModel());
  if (prev) conv.settings = { ...prev.settings }; // a new chat keeps the settings in use
  state.conversations.unshift(conv);
  selectConversation(conv.id);
  $("input").focus();
}

function deleteChat() {
  const conv = current();
  if (!conv || !confirm(`Delete "${conv.title}"?`)) return;
  if (state.running?.conversation === conv) stop();
  state.conversations = state.conversations.filter((c) => c !== conv);
  if (!state.conversations.length) state.conversations.push(store.newConversation(conv.model));
  selectConversation(state.conversations[0].id);
}

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "conversation";
    button.textContent = c.title;
    button.title = c.title;
    if (c.id === state.current) button.setAttribute("aria-current", "true");
    button.addEventListener("click", () => selectConversation(c.id));
    li.appendChild(button);
    list.appendChild(li);
  }
}

function exportAll() {
  const blob = new Blob([store.exportText(state.conversations)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `mlx-engine-chats-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importFile(file) {
  try {
    const imported = store.parseImport(await file.text());
    const ids = new Set(state.conversations.map((c) => c.id));
    for (const c of imported) if (ids.has(c.id)) c.id = store.newId(); // never overwrite a chat here
    state.conversations.unshift(...imported);
    notice(`imported ${imported.length} conversation${imported.length === 1 ? "" : "s"}`);
    selectConversation(imported[0]?.id || state.current);
  } catch (err) {
    notice(`import failed: ${err.message}`);
  }
}

// -- settings ------------------------------------------------------------------------------

const NUMBER_SETTINGS = ["temperature", "top_p", "max_tokens", "seed"];

function renderSettings() {
  const s = current().settings;
  $("system").value = s.system || "";
  for (const k of NUMBER_SETTINGS) $(k).value = s[k] ?? "";
  $("decoding").value = s.decoding || "auto";
}

function readSetting(event) {
  const conv = current();
  const id = event.target.id;
  if (id === "system" || id === "decoding") conv.settings[id] = event.target.value;
  else {
    const v = event.target.value === "" ? null : Number(event.target.value);
    conv.settings[id] = Number.isFinite(v) ? v : null;
  }
  persist();
}

// -- messages ------------------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  const conv = current();
  conv.messages.forEach((m, i) => box.appendChild(messageNode(conv, m, i)));
  box.scrollTop = box.scrollHeight;
}

function messageNode(conv, m, i) {
  const node = document.createElement("article");
  node.className = `msg ${m.role}`;
  node.dataset.index = i;
  node.setAttribute("aria-label", m.role === "user" ? "Your message" : "Answer");
  const body = document.createElement("div");
  body.className = "body";
  fillBody(body, m);
  node.appendChild(body);
  if (m.role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = statsLine(m);
    node.appendChild(stats);
  }
  node.appendChild(actions(conv, m, i));
  return node;
}

function fillBody(body, m) {
  if (m.role === "user") {
    const text = document.createElement("div");
    text.className = "user-text";
    text.textContent = m.content; // the person's own words, as typed
    body.replaceChildren(text);
    for (const url of m.images || []) body.appendChild(thumbnail(url));
    return;
  }
  body.replaceChildren(renderMarkdown(m.content));
  if (m.error) {
    const err = document.createElement("p");
    err.className = "error";
    err.textContent = m.error;
    body.appendChild(err);
  }
}

function thumbnail(url) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.alt = "attached image";
  if (/^data:image\//.test(url)) img.src = url; // only the person's own attachments, as data URIs
  return img;
}

function actions(conv, m, i) {
  const bar = document.createElement("div");
  bar.className = "actions";
  const add = (label, aria, fn) => {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.setAttribute("aria-label", aria);
    b.addEventListener("click", fn);
    bar.appendChild(b);
  };
  if (m.role === "user") add("Edit", "Edit this message", () => startEdit(conv, i));
  else {
    add("Regenerate", "Regenerate this answer", () => regenerate(conv, i));
    add("Copy", "Copy this answer", (e) => copyText(m.content, e.target));
  }
  return bar;
}

function startEdit(conv, i) {
  if (state.running) return;
  const node = $("messages").querySelector(`article[data-index="${i}"]`);
  const area = document.createElement("textarea");
  area.className = "edit";
  area.value = conv.messages[i].content;
  area.setAttribute("aria-label", "Edit message");
  const save = document.createElement("button");
  save.type = "button";
  save.textContent = "Save and send";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const bar = document.createElement("div");
  bar.className = "actions";
  bar.append(save, cancel);
  node.querySelector(".body").replaceChildren(area);
  node.querySelector(".actions").replaceWith(bar);
  area.focus();
  cancel.addEventListener("click", renderMessages);
  const submit = () => {
    conv.messages[i] = { ...conv.messages[i], content: area.value };
    conv.messages.length = i + 1; // what followed answered the old text
    persist();
    renderMessages();
    answer(conv);
  };
  save.addEventListener("click", submit);
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
}

function regenerate(conv, i) {
  if (state.running) return;
  conv.messages.length = i; // the answer and what followed it go
  persist();
  renderMessages();
  answer(conv);
}

/** The engine's measurements of one answer, in a line. */
export function statsLine(m) {
  const s = m.stats;
  if (!s?.mlx_engine) {
    if (m.stopped || m.error) return m.stopped ? "stopped" : "failed";
    return s?.page_ttft != null ? `first token on the page ${s.page_ttft.toFixed(2)} s · streaming…` : "";
  }
  const e = s.mlx_engine;
  const parts = [];
  if (e.generation_tps != null) parts.push(`${e.generation_tps.toFixed(1)} tok/s`);
  if (e.time_to_first_token != null) {
    const page = s.page_ttft != null ? ` (page ${s.page_ttft.toFixed(2)} s)` : "";
    parts.push(`first token ${e.time_to_first_token.toFixed(2)} s${page}`);
  }
  parts.push(`${s.cached_tokens ?? 0}/${s.prompt_tokens ?? "?"} prompt tokens cached`);
  if (e.decoding_mode) parts.push(e.decoding_mode);
  if (e.drafted_tokens) {
    const share = Math.round((100 * e.accepted_tokens) / e.drafted_tokens);
    parts.push(`${e.accepted_tokens}/${e.drafted_tokens} drafted accepted (${share}%)`);
  }
  parts.push(`${s.completion_tokens ?? 0} tokens`);
  if (m.stopped) parts.push("stopped");
  return parts.join(" · ");
}

// -- sending and streaming -----------------------------------------------------------------

async function send() {
  const conv = current();
  const text = $("input").value;
  if (state.running || (!text.trim() && !state.attachments.length)) return;
  const message = { role: "user", content: text };
  if (state.attachments.length) message.images = [...state.attachments];
  conv.messages.push(message);
  if (conv.title === "New chat") conv.title = text.trim().split("\n")[0].slice(0, 48) || "Image";
  $("input").value = "";
  state.attachments = [];
  renderAttachments();
  persist();
  renderConversations();
  $("title").value = conv.title;
  renderMessages();
  await answer(conv);
}

function requestBody(conv) {
  const s = conv.settings;
  const messages = [];
  if (s.system && s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of conv.messages) {
    if (m.role === "user" && m.images?.length) {
      const parts = [{ type: "text", text: m.content }];
      for (const url of m.images) parts.push({ type: "image_url", image_url: { url } });
      messages.push({ role: "user", content: parts });
    } else messages.push({ role: m.role, content: m.content });
  }
  const body = {
    model: conv.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    mlx_engine: { decoding: s.decoding || "auto" },
  };
  for (const k of NUMBER_SETTINGS) if (s[k] != null) body[k] = s[k];
  return body;
}

/** Stream an answer to ``conv``'s last message into a new assistant message. */
async function answer(conv) {
  const started = performance.now();
  if (!conv.model) conv.model = defaultModel() || $("model").value;
  const body = JSON.stringify(requestBody(conv)); // the conversation up to here, without the answer to come
  const message = { role: "assistant", content: "" };
  conv.messages.push(message);
  const controller = new AbortController();
  state.running = { controller, conversation: conv, message };
  setRunning(true);
  renderMessages();
  const node = $("messages").lastElementChild;
  const view = { body: node.querySelector(".body"), stats: node.querySelector(".stats") };
  try {
    await stream(conv, body, message, controller.signal, started, view);
  } catch (err) {
    if (err.name === "AbortError") message.stopped = true;
    else message.error = err.message;
  } finally {
    state.running = null;
    conv.updated = Date.now();
    setRunning(false);
    persist();
    if (current() === conv) renderMessages();
    refreshModels(); // a model loaded on demand now shows as loaded
  }
}

async function stream(conv, body, message, signal, started, view) {
  const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body, signal });
  if (response.status === 401) {
    await askKey("The server needs an API key."); // then the same request again, with it
    return stream(conv, body, message, signal, started, view);
  }
  if (!response.ok) throw new HttpError(response.status, await errorText(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split("\n\n");
    buffer = events.pop();
    let changed = false;
    for (const event of events) changed = handleEvent(event, message, started) || changed;
    if (changed && current() === conv) {
      fillBody(view.body, message);
      view.stats.textContent = statsLine(message);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
  }
}

/** Apply one server-sent event to ``message``; true when something shows. */
function handleEvent(event, message, started) {
  const data = event
    .split("\n")
    .filter((l) => l.startsWith("data:"))
    .map((l) => l.slice(5).trim())
    .join("\n");
  if (!data || data === "[DONE]") return false;
  const chunk = JSON.parse(data);
  if (chunk.error) {
    message.error = chunk.error.message;
    return true;
  }
  if (chunk.usage) {
    message.stats = {
      ...message.stats,
      prompt_tokens: chunk.usage.prompt_tokens,
      completion_tokens: chunk.usage.completion_tokens,
      cached_tokens: chunk.usage.prompt_tokens_details?.cached_tokens ?? 0,
      mlx_engine: chunk.usage.mlx_engine,
    };
    return true;
  }
  const text = chunk.choices?.[0]?.delta?.content;
  if (!text) return false;
  if (!message.content) message.stats = { page_ttft: (performance.now() - started) / 1000 };
  message.content += text;
  return true;
}

function stop() {
  state.running?.controller.abort();
}

function setRunning(running) {
  $("send").hidden = running;
  $("stop").hidden = !running;
  $("stop").disabled = !running;
  if (!running) $("input").focus();
}

// -- attachments ---------------------------------------------------------------------------

async function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      notice(`${file.name} is not an image`);
      continue;
    }
    state.attachments.push(await readDataURL(file));
  }
  renderAttachments();
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  state.attachments.forEach((url, i) => {
    const wrap = document.createElement("span");
    wrap.className = "attachment";
    wrap.appendChild(thumbnail(url));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.addEventListener("click", () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    });
    wrap.appendChild(remove);
    box.appendChild(wrap);
  });
}

// -- page ----------------------------------------------------------------------------------

let noticeTimer = null;
function notice(text) {
  const p = $("notice");
  p.textContent = text;
  p.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => (p.hidden = true), 8000);
}

function renderAll() {
  const conv = current();
  $("title").value = conv.title;
  renderConversations();
  renderSettings();
  renderModels();
  renderMessages();
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("delete-chat").addEventListener("click", deleteChat);
  $("title").addEventListener("change", () => {
    current().title = $("title").value.trim() || "Untitled";
    persist();
    renderConversations();
  });
  $("export").addEventListener("click", exportAll);
  $("import-file").addEventListener("change", (e) => {
    if (e.target.files[0]) importFile(e.target.files[0]);
    e.target.value = "";
  });
  $("model").addEventListener("change", () => {
    current().model = $("model").value;
    persist();
    renderModels();
  });
  $("model").addEventListener("focus", refreshModels);
  $("model-action").addEventListener("click", loadOrUnload);
  $("model-refresh").addEventListener("click", refreshModels);
  for (const id of ["system", "decoding", ...NUMBER_SETTINGS]) $(id).addEventListener("change", readSetting);
  $("toggle-settings").addEventListener("click", () => toggle("settings", "toggle-settings"));
  $("toggle-sidebar").addEventListener("click", () => {
    const shown = document.body.classList.toggle("show-sidebar");
    $("toggle-sidebar").setAttribute("aria-expanded", String(shown));
  });
  $("attach").addEventListener("change", (e) => {
    attach([...e.target.files]);
    e.target.value = "";
  });
}

function toggle(id, buttonId) {
  const section = $(id);
  section.hidden = !section.hidden;
  $(buttonId).setAttribute("aria-expanded", String(!section.hidden));
}

async function start() {
  wire();
  const saved = store.load();
  state.conversations = saved.conversations;
  state.current = saved.current;
  if (!state.conversations.length) state.conversations.push(store.newConversation(null));
  if (!current()) state.current = state.conversations[0].id;
  renderAll();
  await refreshModels();
  persist();
  document.body.dataset.ready = "true"; // tests and the benchmark wait for this
}

start();
