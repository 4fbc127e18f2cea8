"""Benchmark workloads built from held-out Python stdlib files.

Every workload is a token prompt (plus, for ``multi-turn``, an untimed first
turn). Texts come from ``training/corpus.py``'s held-out files, which the
SmolLM2 draft (training/smollm2_prompts.py) and the retired toy pair never saw
in training; if it finds none a fixed list of stdlib files is read directly.
"""

from __future__ import annotations

import builtins
import keyword
import logging
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

Tokenize = Callable[[str], list[int]]
#: Greedy continuation used to build the second multi-turn request:
#: (prompt tokens, max new tokens) -> generated tokens.
Continue = Callable[[list[int], int], list[int]]

ECHO_SEPARATOR = "\n# The same code again:\n"
EDIT_SEPARATOR = "\n\n# The same code with `{old}` renamed to `{new}`:\n"
TURN_SEPARATOR = "\n\n# Next, another piece of code:\n"
FALLBACK_FILES = (
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "shlex.py",
    "string.py",
    "calendar.py",
    "csv.py",
)

QA_PATTERN = r'^def [^\n]*:\n[ \t]+"""[^\n]*"""\n'  # a def with a one-line docstring
KINDS = ("echo", "code-edit", "open-gen", "qa-short", "multi-turn")


@dataclass
class Workload:
    """One prompt to benchmark. ``setup`` is the first request of a multi-turn
    workload, run (untimed) right before the measured request so an engine kit can
    reuse its cache."""

    name: str
    kind: str
    source: str
    prompt: list[int]
    setup: list[int] | None = None
    setup_tokens: int = 0
    notes: str = ""
    meta: dict = field(default_factory=dict)


#: Where the last ``load_texts`` call found its texts (for the report).
text_source = ""


def load_texts() -> dict[str, str]:
    """Held-out stdlib texts, ``relative path -> text``."""
    global text_source
    from training import corpus

    texts = corpus.read_heldout_texts()
    if texts:
        text_source = "held-out stdlib files from `training/corpus.py`, never seen in training"
        return texts
    logger.warning("training/corpus.py found no held-out files; reading a fixed list of stdlib files")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text_source = "stdlib files read directly (training/corpus.py found none)"
    return {name: (stdlib / name).read_text(encoding="utf-8") for name in FALLBACK_FILES if (stdlib / name).is_file()}


def _code_body(text: str) -> list[str]:
    """Lines of ``text`` from its first top-level def/class (skips license headers
    and module docstrings, which are mostly prose)."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("def ", "class ")):
            return lines[i:]
    return lines


def _take_tokens(lines: list[str], budget: int, tokenize: Tokenize) -> str:
    """The longest whole-line prefix of ``lines`` within ``budget`` tokens (at
    least one line)."""
    chars, end = 0, 0
    while end < len(lines) and chars <= budget * 12:  # skip tokenizing far more text than fits
        chars += len(lines[end])
        end += 1
    lines = lines[:end]
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenize("".join(lines[:mid]))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def _rename_target(passage: str) -> str | None:
    """The passage's most frequent identifier that is not a keyword or builtin."""
    skip = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}
    words = Counter(w for w in re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", passage) if w not in skip)
    return words.most_common(1)[0][0] if words else None


def _fit(
    builder: Callable[[str, int, Tokenize], tuple[list[int], str]], text: str, length: int, tokenize: Tokenize
) -> tuple[list[int], str]:
    """Run ``builder`` with a budget shrunk until its prompt is near ``length`` tokens."""
    budget = length
    toks, notes = builder(text, budget, tokenize)
    for _ in range(4):
        if len(toks) <= length * 1.08 or budget < 16:
            break
        budget = int(budget * length / len(toks))
        toks, notes = builder(text, budget, tokenize)
    return toks, notes


def _echo(text: str, length: int, tokenize: Tokenize) -> tuple[list[int], str]:
    sep = len(tokenize(ECHO_SEPARATOR))
    passage = _take_tokens(_code_body(text), int((length - sep) / 1.06), tokenize)
    lines = passage.splitlines(keepends=True)
    head_lines = max(1, min(3, len(lines) // 4))
    head = "".join(lines[:head_lines])
    prompt = passage + ECHO_SEPARATOR + head
    return tokenize(prompt), f"{len(lines)}-line passage, then its first {head_lines} lines again"


def _code_edit(text: str, length: int, tokenize: Tokenize) -> tuple[list[int], str]:
    cut_frac = 0.4
    passage = _take_tokens(_code_body(text), int(length / (1 + cut_frac + 0.04)), tokenize)
    old = _rename_target(passage) or "self"
    new = f"{old}_new" if old != "self" else "this"
    edited = re.sub(rf"\b{re.escape(old)}\b", new, passage)
    first = re.search(rf"\b{re.escape(new)}\b", edited)
    start = max(first.end() if first else 0, int(len(edited) * cut_frac))
    # Cut at the end of that line if the line ends early enough, else at a space.
    eol = edited.find("\n", start)
    if 0 <= eol < len(edited) * 0.75:
        cut = eol + 1
    else:
        space = edited.find(" ", start)
        cut = space if 0 <= space < len(edited) - 1 else start
    prompt = passage + EDIT_SEPARATOR.format(old=old, new=new) + edited[:cut]
    return tokenize(prompt), f"rename `{old}` -> `{new}`; the edited copy is cut after {cut / len(edited):.0%} of it"


def _open_gen(text: str, length: int, tokenize: Tokenize) -> tuple[list[int], str]:
    prompt = _take_tokens(text.splitlines(keepends=True), length, tokenize)
    return tokenize(prompt), "start of the file"


def _qa_short(text: str, tokenize: Tokenize) -> tuple[list[int], str]:
    """A def line plus its docstring (under 64 tokens): the model writes the body."""
    m = re.search(QA_PATTERN, text, re.M)
    prompt = m.group(0) if m else 'def median(values):\n    """Return the median of a list of numbers."""\n'
    toks = tokenize(prompt)
    while len(toks) >= 64:
        prompt = prompt[: int(len(prompt) * 0.8)]
        toks = tokenize(prompt)
    return toks, "a def line and its docstring"


def build_workloads(
    tokenize: Tokenize,
    continue_fn: Continue,
    *,
    lengths: tuple[int, ...],
    multi_turn_lengths: tuple[int, ...],
    kinds: tuple[str, ...] = KINDS,
    setup_tokens: int = 128,
) -> list[Workload]:
    """All workloads: each kind at each prompt length (``qa-short`` once)."""
    texts = load_texts()
    names = list(texts)
    if not names:
        raise RuntimeError("no held-out texts found")
    pick = lambda i: names[i % len(names)]  # noqa: E731 - rotate files across workloads
    out: list[Workload] = []
    for li, length in enumerate(lengths):
        for kind, builder, offset in (("echo", _echo, 0), ("code-edit", _code_edit, 3), ("open-gen", _open_gen, 6)):
            if kind not in kinds:
                continue
            src = pick(li + offset)
            toks, notes = _fit(builder, texts[src], length, tokenize)
            out.append(Workload(f"{kind}-{length}", kind, src, toks, notes=notes))
    if "qa-short" in kinds:
        src = next((n for n in names if re.search(QA_PATTERN, texts[n], re.M)), names[0])
        toks, notes = _qa_short(texts[src], tokenize)
        out.append(Workload("qa-short", "qa-short", src, toks, notes=notes))
    if "multi-turn" in kinds:
        for li, length in enumerate(multi_turn_lengths):
            src, src2 = pick(li + 9), pick(li + 10)
            first = tokenize(_take_tokens(_code_body(texts[src]), length, tokenize))
            reply = continue_fn(first, setup_tokens)
            chunk = tokenize(TURN_SEPARATOR + _take_tokens(_code_body(texts[src2]), 48, tokenize))
            second = first + reply + chunk
            out.append(
                Workload(
                    f"multi-turn-{length}",
                    "multi-turn",
                    f"{src} + {src2}",
                    second,
                    setup=first,
                    setup_tokens=setup_tokens,
                    notes=f"turn 1: {len(first)} tokens -> {len(reply)} generated; turn 2 adds {len(chunk)}",
                    meta={"shared_prefix": len(first) + len(reply)},
                )
            )
    return out
