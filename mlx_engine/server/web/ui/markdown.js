// A small Markdown renderer that builds DOM nodes and sets only textContent:
// model output never reaches innerHTML, so it cannot run script, add event
// handlers or load anything. No <img> is ever made (an image in Markdown shows
// as its text); links are made only for http(s) and mailto, and open a new tab
// when clicked, without a referrer.
//
// Covers what chat answers use: fenced code blocks (with a copy button),
// headings, lists, block quotes, rules, paragraphs (single newlines kept), and
// inline code, bold, italics, strike-through and links. An unclosed code fence
// (an answer still streaming) is a code block to the end.

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

const INLINE = [
  ["code", /`([^`\n]+)`/],
  ["image", /!\[([^\]\n]*)\]\(([^)\s]*)\)/],
  ["link", /\[([^\]\n]+)\]\(([^)\s]+)\)/],
  ["url", /\bhttps?:\/\/[^\s<>()]*[^\s<>().,;:!?'"]/],
  ["strong", /\*\*(?=\S)([\s\S]*?\S)\*\*|(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/], // no _ inside words
  ["del", /~~(?=\S)([\s\S]*?\S)~~/],
  ["em", /\*(?=[^\s*])([^*]*?[^\s*])\*|(?<![\w])_(?=\S)([^_]*?\S)_(?![\w])/],
];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function safeHref(url) {
  return /^(https?:\/\/|mailto:)/i.test(url) ? url : null;
}

/** Append ``text``'s inline Markdown to ``parent`` as nodes. */
export function renderInline(text, parent) {
  let rest = text;
  while (rest) {
    let best = null;
    for (const [kind, re] of INLINE) {
      const m = re.exec(rest);
      if (m && (best === null || m.index < best.m.index)) best = { kind, m };
    }
    if (best === null) {
      appendText(parent, rest);
      return;
    }
    const { kind, m } = best;
    if (m.index > 0) appendText(parent, rest.slice(0, m.index));
    parent.appendChild(inlineNode(kind, m));
    rest = rest.slice(m.index + m[0].length);
  }
}

function inlineNode(kind, m) {
  if (kind === "code") return el("code", null, m[1]);
  if (kind === "image") return el("span", "md-image", m[0]); // shown as text: nothing is loaded
  if (kind === "link" || kind === "url") {
    const href = safeHref(kind === "url" ? m[0] : m[2]);
    if (!href) return document.createTextNode(m[0]);
    const a = el("a");
    a.href = href;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    if (kind === "url") a.textContent = m[0];
    else renderInline(m[1], a);
    return a;
  }
  const node = el(kind === "strong" ? "strong" : kind === "del" ? "del" : "em");
  renderInline(m[1] ?? m[2] ?? "", node);
  return node;
}

function appendText(parent, text) {
  // Single newlines inside a paragraph are kept as line breaks (chat answers rely on them).
  const lines = text.split("\n");
  lines.forEach((line, i) => {
    if (i > 0) parent.appendChild(el("br"));
    if (line) parent.appendChild(document.createTextNode(line));
  });
}

/** A code block: its language, a copy button and the code as text. */
export function codeBlock(code, lang) {
  const box = el("div", "code-block");
  const head = el("div", "code-head");
  head.appendChild(el("span", "code-lang", lang || "code"));
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  copy.addEventListener("click", () => copyText(code, copy));
  head.appendChild(copy);
  const pre = el("pre");
  pre.appendChild(el("code", null, code));
  box.append(head, pre);
  return box;
}

/** Copy ``text`` to the clipboard; says so on ``button``. */
export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // Not a secure context (a LAN address over http): the old way.
    const area = el("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  if (button) {
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => (button.textContent = label), 1200);
  }
}

/** Render ``text`` as Markdown into a new element. */
export function renderMarkdown(text) {
  const root = el("div", "md");
  renderBlocks(String(text ?? "").replace(/\r\n?/g, "\n").split("\n"), root);
  return root;
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    const step = fence(lines, i, parent) || heading(lines, i, parent) || rule(lines, i, parent);
    if (step) {
      i = step;
      continue;
    }
    i = quote(lines, i, parent) || list(lines, i, parent) || paragraph(lines, i, parent);
  }
}

function fence(lines, i, parent) {
  const m = FENCE.exec(lines[i]);
  if (!m) return 0;
  const marker = m[1];
  const body = [];
  let j = i + 1;
  while (j < lines.length && !lines[j].trim().startsWith(marker)) body.push(lines[j++]);
  parent.appendChild(codeBlock(body.join("\n"), m[2]));
  return j + 1;
}

function heading(lines, i, parent) {
  const m = HEADING.exec(lines[i]);
  if (!m) return 0;
  const h = el("h" + Math.min(6, m[1].length + 2)); // h3..h6: answers sit below the page's own headings
  renderInline(m[2], h);
  parent.appendChild(h);
  return i + 1;
}

function rule(lines, i, parent) {
  if (!RULE.test(lines[i])) return 0;
  parent.appendChild(el("hr"));
  return i + 1;
}

function quote(lines, i, parent) {
  if (!QUOTE.test(lines[i])) return 0;
  const inner = [];
  let j = i;
  while (j < lines.length && QUOTE.test(lines[j])) inner.push(QUOTE.exec(lines[j++])[1]);
  const box = el("blockquote");
  renderBlocks(inner, box);
  parent.appendChild(box);
  return j;
}

function list(lines, i, parent) {
  const first = ITEM.exec(lines[i]);
  if (!first) return 0;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let j = i;
  while (j < lines.length && lines[j].trim()) {
    const m = ITEM.exec(lines[j]);
    if (m && /\d/.test(m[2]) === ordered && m[1].length <= first[1].length + 1) {
      items.push([m[3]]);
    } else if (m && m[1].length > first[1].length + 1) {
      items[items.length - 1].push(m[0].trim()); // a nested item: kept as a line of its parent
    } else if (m || FENCE.test(lines[j]) || HEADING.test(lines[j])) {
      break; // another kind of list or block ends this one
    } else {
      items[items.length - 1].push(lines[j].trim()); // a continuation line of the item
    }
    j++;
  }
  const box = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) box.start = parseInt(first[2], 10);
  for (const text of items) renderInline(text.join("\n"), box.appendChild(el("li")));
  parent.appendChild(box);
  return j;
}

function paragraph(lines, i, parent) {
  const body = [];
  let j = i;
  while (
    j < lines.length &&
    lines[j].trim() &&
    !(j > i && (FENCE.test(lines[j]) || HEADING.test(lines[j]) || QUOTE.test(lines[j]) || ITEM.test(lines[j])))
  ) {
    body.push(lines[j++]);
  }
  const p = el("p");
  renderInline(body.join("\n"), p);
  parent.appendChild(p);
  return j;
}
