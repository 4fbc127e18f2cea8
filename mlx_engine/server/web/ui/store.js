// Conversations kept in the browser's localStorage (they survive a reload),
// and their export and import as JSON.
//
// A conversation: {id, title, created, updated, model, settings, messages}; a
// message: {role: "user"|"assistant", content, images?: [data URI], stats?,
// stopped?, error?}; settings: {system, temperature, top_p, max_tokens, seed,
// decoding}.

const KEY = "mlx-engine.chat.v1";
export const FORMAT = "mlx-engine-chat";

export const DEFAULT_SETTINGS = {
  system: "",
  temperature: 0.7,
  top_p: 1,
  max_tokens: 512,
  seed: null,
  decoding: "auto",
};

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export function newConversation(model) {
  const now = Date.now();
  return {
    id: newId(),
    title: "New chat",
    created: now,
    updated: now,
    model: model || null,
    settings: { ...DEFAULT_SETTINGS },
    messages: [],
  };
}

/** {conversations, current} from storage (an empty list when none or unreadable). */
export function load() {
  try {
    const data = JSON.parse(localStorage.getItem(KEY) || "null");
    if (data && Array.isArray(data.conversations)) {
      return { conversations: data.conversations.map(normalize).filter(Boolean), current: data.current || null };
    }
  } catch (err) {
    console.warn("stored conversations unreadable", err);
  }
  return { conversations: [], current: null };
}

/** Save; returns an error message when the browser refuses (storage full), else null. */
export function save(state) {
  try {
    localStorage.setItem(KEY, JSON.stringify({ conversations: state.conversations, current: state.current }));
    return null;
  } catch (err) {
    return `could not save the conversations in this browser (${err.name}): attached images take much room`;
  }
}

/** The JSON text of an export file. */
export function exportText(conversations) {
  return JSON.stringify({ format: FORMAT, version: 1, exported: new Date().toISOString(), conversations }, null, 2);
}

/** The conversations of an export file's text; throws Error naming what is wrong. */
export function parseImport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new Error("the file is not JSON");
  }
  const list = Array.isArray(data) ? data : data && data.conversations;
  if (!Array.isArray(list)) throw new Error("the file has no 'conversations' list");
  const out = list.map(normalize);
  const bad = out.indexOf(null);
  if (bad >= 0) throw new Error(`conversations[${bad}] is not a conversation (needs a 'messages' list)`);
  return out;
}

function normalize(c) {
  if (!c || typeof c !== "object" || !Array.isArray(c.messages)) return null;
  const messages = c.messages
    .filter((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string")
    .map((m) => ({
      role: m.role,
      content: m.content,
      ...(Array.isArray(m.images) ? { images: m.images.filter((u) => typeof u === "string" && u.startsWith("data:image/")) } : {}),
      ...(m.stats && typeof m.stats === "object" ? { stats: m.stats } : {}),
      ...(m.stopped ? { stopped: true } : {}),
      ...(typeof m.error === "string" ? { error: m.error } : {}),
    }));
  return {
    id: typeof c.id === "string" && c.id ? c.id : newId(),
    title: typeof c.title === "string" && c.title ? c.title : "Imported chat",
    created: Number(c.created) || Date.now(),
    updated: Number(c.updated) || Date.now(),
    model: typeof c.model === "string" ? c.model : null,
    settings: { ...DEFAULT_SETTINGS, ...(c.settings && typeof c.settings === "object" ? c.settings : {}) },
    messages,
  };
}
