"""A draft model's files against a target: the compatibility check (vocabulary,
special tokens, a cache whose every layer can rewind: hybrids too) and loading
its weights into a ``draft.model.DraftModel``. Putting it into a kit (and taking
it out) is ``kits/drafts.py``; the drafter that uses it is ``drafters/draft_model.py``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from mlx_lm.models.cache import make_prompt_cache

from ..caches.sequence import layer_rewind_reason
from ..errors import ModelLoadError
from ..loading import model as loading
from .model import DraftModel

logger = logging.getLogger(__name__)


@dataclass
class DraftCompatibility:
    """Whether a draft model can serve a kit: ``reasons`` lists everything that
    breaks speculation (the draft is refused), ``notes`` the differences that do
    not (the main model verifies every drafted token), such as special-token
    settings or embedding rows padded past the vocabulary."""

    compatible: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What drafts: "draft_model" (a separate model) or a head ("eagle3"); a head
    # also says which target hidden states it reads (decoder layer indices whose
    # outputs, or -1: the final normed state) and how its vocabulary maps.
    kind: str = "draft_model"
    hidden_states: tuple[int, ...] = ()
    vocabulary: str = "the target's tokenizer"

    def __bool__(self) -> bool:
        return self.compatible


def _special_ids(tok) -> dict[str, int | None]:
    return {
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": getattr(tok, "pad_token_id", None),
    }


def _rewind_reason(config: dict) -> str | None:
    """Why the draft's cache could not rewind a rejected draft, or None: asked
    of each layer of the cache the architecture makes (attention layers trim,
    recurrent ones restore a kept state; cache.layer_rewind_reason). The model
    is built without its weights: its arrays are lazy, nothing is computed."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    return next((r for c in make_prompt_cache(model) if (r := layer_rewind_reason(c))), None)


def _compare_vocabularies(main_tok, draft_tok, main_rows: int) -> tuple[list[str], list[str]]:
    """(reasons, notes) from the two token lists. A draft proposes ids below the
    main model's row count; one whose token at such an id is another token for
    the main model breaks speculation, anything else only lowers acceptance."""
    main_vocab, draft_vocab = main_tok.get_vocab(), draft_tok.get_vocab()
    if main_vocab == draft_vocab:
        return [], []
    main_by_id = {i: t for t, i in main_vocab.items()}
    mismatched = sum(1 for t, i in draft_vocab.items() if i < main_rows and main_by_id.get(i, t) != t)
    reasons, notes = [], []
    if mismatched:
        reasons.append(
            f"tokenizers differ: {mismatched} of the draft's {len(draft_vocab)} tokens map to a different token "
            f"of the main model's {len(main_vocab)}"
        )
    unknown = sum(1 for t, i in draft_vocab.items() if i < main_rows and i not in main_by_id)
    missing = sum(1 for t, i in main_vocab.items() if draft_vocab.get(t) != i)
    if unknown:
        notes.append(f"the draft has {unknown} tokens at ids the main tokenizer does not use (never accepted)")
    if missing and not mismatched:
        notes.append(f"{missing} of the main model's tokens are not in the draft's tokenizer (never drafted)")
    return reasons, notes


def _special_notes(main_tok, draft_tok, main_rows: int, draft_rows) -> list[str]:
    """Differences the verify loop makes harmless: stopping and padding follow
    the main tokenizer, and drafts are cut to the main model's rows."""
    notes = []
    main_special, draft_special = _special_ids(main_tok), _special_ids(draft_tok)
    for name, value in main_special.items():
        if value != draft_special[name]:
            notes.append(f"{name} differs: main {value}, draft {draft_special[name]} (the main tokenizer's is used)")
    if set(main_tok.all_special_ids) != set(draft_tok.all_special_ids):
        notes.append("the tokenizers mark different sets of ids as special (the main tokenizer's are used)")
    if isinstance(draft_rows, int) and draft_rows != main_rows:
        notes.append(
            f"embedding rows differ: main {main_rows}, draft {draft_rows} (rows past the vocabulary are never drafted)"
        )
    return notes


def check_draft_files(tokenizer, vocab_size: int, draft_path: Path) -> DraftCompatibility:
    """Check a separate draft model's files against a target's tokenizer and
    vocabulary size, reading only the draft's config and tokenizer (no weights)."""
    reasons: list[str] = []
    try:
        config = loading.read_config(draft_path)
        if loading.is_vision_config(config):
            reasons.append("the draft is a vision model; a draft must be a text-only model")
        loading.check_architecture(config, draft_path)
        draft_tok = loading.load_tokenizer(draft_path)
    except (ModelLoadError, ValueError) as exc:
        return DraftCompatibility(False, [str(exc)])
    vocab_reasons, notes = _compare_vocabularies(tokenizer, draft_tok, vocab_size)
    reasons += vocab_reasons
    notes += _special_notes(tokenizer, draft_tok, vocab_size, config.get("vocab_size"))
    try:
        if why := _rewind_reason(config):
            reasons.append(f"the draft architecture {config['model_type']!r} cannot rewind its cache: {why}")
    except Exception as exc:  # a config mlx-lm cannot build a model from
        reasons.append(f"could not inspect the draft architecture: {exc}")
    return DraftCompatibility(not reasons, reasons, notes)


def load_draft_files(draft_path: Path, new_cache) -> DraftModel:
    """Load, prepare and smoke-test a separate draft model's weights;
    ``new_cache(model)`` builds its cache the way the target kit builds caches."""
    model, _ = loading.load_weights(draft_path, trust_remote_code=False)
    loading.prepare_weights(model, "auto")
    loading.smoke_test(model, draft_path)
    return DraftModel(draft_path, model, new_cache(model), loading.float_param_count(model))
