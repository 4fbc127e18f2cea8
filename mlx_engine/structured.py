"""Structured output: JSON schemas, regular expressions and Lark grammars.

llguidance (a dependency of mlx-vlm, so already installed) compiles the
constraint and, given the tokens so far, computes which tokens may come next in
tens of microseconds. ``GrammarConstraint`` keeps one llguidance matcher per
request in step with the accepted tokens; the verify loop asks it for a mask at
every position of a verify pass (the matcher walks the drafts and rolls them
back), truncates drafts at the first token the grammar forbids, and drafts the
tokens the grammar forces (keys, punctuation) for free.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import InvalidArgument

logger = logging.getLogger(__name__)

CONSTRAINT_ARGS = ("json_schema", "regex", "grammar")
# llguidance's JSON layout options; a schema's own "x-guidance" replaces them.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def compile_constraint(json_schema: Any = None, regex: Any = None, grammar: Any = None) -> tuple[str, str] | None:
    """``(argument name, llguidance grammar)`` for the one constraint given, or
    None; ``ValueError`` naming the argument for anything malformed."""
    import llguidance

    given = [(n, v) for n, v in zip(CONSTRAINT_ARGS, (json_schema, regex, grammar)) if v is not None]
    if len(given) > 1:
        both = " and ".join("{%s}" % n for n, _ in given)
        every = ", ".join("{%s}" % n for n in CONSTRAINT_ARGS)
        raise InvalidArgument(f"{both} were both given; pass at most one of {every}", given[0][0])
    if not given:
        return None
    name, value = given[0]
    try:
        if name == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ValueError(f"must be a JSON object (a dict or its JSON text), got {type(schema).__name__}")
            if "x-guidance" not in schema:
                # Compact JSON: with one way to write whitespace, keys and punctuation
                # become forced spans that are drafted for free.
                schema = {**schema, "x-guidance": dict(JSON_LAYOUT)}
            return name, llguidance.LLMatcher.grammar_from_json_schema(schema)
        if not isinstance(value, str) or not value:
            raise ValueError(f"must be a non-empty string, got {value!r}")
        if name == "regex":
            return name, llguidance.LLMatcher.grammar_from_regex(value)
        return name, llguidance.LLMatcher.grammar_from_lark(value)
    except (ValueError, TypeError, RuntimeError, json.JSONDecodeError) as exc:
        raise InvalidArgument("{param} is not valid: {detail}", name, detail=exc) from exc


def validate_constraint(json_schema: Any = None, regex: Any = None, grammar: Any = None) -> None:
    """Check a constraint without a tokenizer (before any model is loaded):
    ``InvalidArgument`` naming the argument for one llguidance cannot compile.
    ``check_grammar`` (with the kit) still runs when the request is made."""
    import llguidance

    compiled = compile_constraint(json_schema, regex, grammar)
    if compiled is None:
        return
    name, text = compiled
    error = llguidance.LLMatcher.validate_grammar(text, None)
    if error:
        raise InvalidArgument("{param} cannot be used: {detail}", name, detail=_describe(error))


# llguidance's view of each kit's tokenizer, kept here (weakly, so it goes with
# the kit) rather than on the kit: validation writes nothing on the kit.
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def tokenizer_for(kit) -> Any:
    """The kit's llguidance tokenizer view (built once per kit: ~0.5 s for a
    49k vocabulary). Its size is the model's, so padded embedding rows are
    simply never allowed."""
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(kit)
    if cached is None:
        import llguidance.hf

        hf = getattr(kit.tokenizer, "_tokenizer", kit.tokenizer)
        eos = sorted(kit.eos_token_ids) or None
        try:
            cached = llguidance.hf.from_tokenizer(hf, n_vocab=kit.vocab_size, eos_token=eos)
        except Exception as exc:
            raise ValueError(f"structured output needs a fast (Rust) Hugging Face tokenizer: {exc}") from exc
        with _TOKENIZERS_LOCK:
            cached = _TOKENIZERS.setdefault(kit, cached)
    return cached


# Forced tokens consumed by the probe in ``check_grammar``: enough to reach the
# first lexeme of a forced span, where llguidance hits its lexer and parser
# limits (a regex such as ``a{1000000}``, a schema that requires itself).
PROBE_FORCED_TOKENS = 8
# Positions the probe walks: where limits met right after a first choice (a
# huge repetition after an alternative, ``[ab]c{100000}``) show.
PROBE_STEPS = 4


def check_grammar(kit, name: str, grammar: str) -> None:
    """Refuse, before any model work, a grammar llguidance cannot build for this
    tokenizer or cannot run: a probe matcher walks the first ``PROBE_STEPS``
    positions of one path (the forced tokens where there are some, else the
    lowest allowed token that is not an end token), computing each mask, where
    grammars too large or too complex for llguidance's limits fail (``ValueError``
    naming the argument). A limit met only on another path, or further along,
    still ends the generation with that error when it is reached."""
    import llguidance

    try:
        matcher = llguidance.LLMatcher(tokenizer_for(kit), grammar, log_level=0)
        _probe_path(matcher, set(kit.eos_token_ids))
        error = matcher.get_error() if matcher.is_error() else ""
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # llguidance reports Rust panics as pyo3's PanicException (a BaseException)
        error = f"{type(exc).__name__}: {exc}"
    if error:
        raise InvalidArgument("{param} cannot be used: {detail}", name, detail=_describe(error))


def _probe_path(matcher, eos_ids: set[int]) -> None:
    """Walk ``matcher`` along one path of ``PROBE_STEPS`` positions (see
    ``check_grammar``); it stops early at an error, a stop or a dead end."""
    for _ in range(PROBE_STEPS):
        if matcher.is_error() or matcher.is_stopped():
            return
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        forced = matcher.compute_ff_tokens()[:PROBE_FORCED_TOKENS]
        if matcher.is_error():
            return
        if not forced:
            allowed = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
            forced = [int(t) for t in allowed[:64] if int(t) not in eos_ids][:1]
        if not forced or not matcher.consume_tokens(forced):
            return


def _describe(error: str) -> str:
    """The first line of llguidance's error (the rest is its parser state), with
    its internal assertions said in words."""
    lines = error.strip().splitlines()
    first = lines[0] if lines else "unknown llguidance error"
    if first.endswith(":"):  # a parser's report follows on its own lines (a regex's "unclosed group")
        detail = []
        for ln in lines[1:]:
            if " | " in ln and ln.split(" | ")[0].strip().isdigit():
                break  # llguidance's echo of the grammar's line
            detail += [ln.strip()] if ln.strip() else []
        first = " ".join([first, *detail])
    if "panic" in first or "assertion" in first:
        return f"it is too large or complex for llguidance ({first})"
    if "too many" in first.lower():
        return f"it is too complex for llguidance's limits ({first})"
    return first


class GrammarConstraint:
    """One request's grammar state: masks for verify passes, draft checks,
    forced tokens, and advancing by the tokens the loop emits."""

    def __init__(self, kit, grammar: str, draft_forced: bool = True, source: str = "grammar"):
        import llguidance

        self.source = source  # the argument the grammar came from, named by a failure
        self.vocab_size = kit.vocab_size
        self.draft_forced = draft_forced
        self.eos_ids = set(kit.eos_token_ids)
        self.matcher = llguidance.LLMatcher(tokenizer_for(kit), grammar, log_level=0)
        self._raise_on_error()

    def _raise_on_error(self) -> None:
        """A matcher in error: the grammar hit one of llguidance's limits past the
        positions ``check_grammar`` probes (a huge rule after a choice, say). The
        request's argument is at fault, not the engine: ``InvalidArgument``."""
        if self.matcher.is_error():
            error = _describe(self.matcher.get_error())
            raise InvalidArgument("{param} cannot be used: {detail}", self.source, detail=error)

    @property
    def complete(self) -> bool:
        """True once the grammar allows nothing more (only the end of the text)."""
        return self.matcher.is_stopped()

    def allowed_prefix(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar accepts."""
        return drafts[: self.matcher.validate_tokens(drafts)] if drafts else drafts

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces next (none when there is a choice). An end
        token is never drafted: the grammar completes before it, in every mode."""
        if limit <= 0 or not self.draft_forced:
            return []
        out = []
        for tok in self.matcher.compute_ff_tokens()[:limit]:
            if tok in self.eos_ids:
                break
            out.append(tok)
        return out

    def masks(self, drafts: list[int]) -> mx.array:
        """Allowed tokens at each of the ``len(drafts) + 1`` verify positions, as
        a (k+1, vocab) bool array: position i is masked as after ``drafts[:i]``.
        Drafts must be grammar-valid (``allowed_prefix``)."""
        import llguidance.numpy

        bits = llguidance.numpy.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        consumed = 0
        for i in range(len(drafts) + 1):
            llguidance.numpy.fill_next_token_bitmask(self.matcher, bits, i)
            if i < len(drafts):
                if not self.matcher.consume_token(drafts[i]):
                    self._raise_on_error()  # a limit reached while checking the drafts
                    raise RuntimeError(f"structured output: draft token {drafts[i]} was checked but not accepted")
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return mx.array(unpacked.astype(np.bool_))

    def advance(self, tokens: list[int]) -> int:
        """Commit tokens the loop emitted (each was sampled under its mask), up to
        the one that completes the grammar; returns how many were committed."""
        for i, tok in enumerate(tokens):
            if not self.matcher.consume_token(tok):
                self._raise_on_error()
            if self.matcher.is_stopped():
                return i + 1
        return len(tokens)


def apply_mask(logits: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))
