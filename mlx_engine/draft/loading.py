"""Draft models in and out of a kit: the compatibility check (vocabulary,
special tokens, a cache whose every layer can rewind: hybrids too), loading and unloading. The draft
model's weights and cache pool are ``draft_pool.DraftModel``; the drafter that
uses them is draft_model.py."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..caches.sequence import layer_rewind_reason
from ..errors import IncompatibleDraftModelError, ModelLoadError
from ..heads import loading as heads
from ..loading import model as loading
from .model import DraftModel

if TYPE_CHECKING:  # annotations only: the kit holds the draft, this module only fills its slot
    from ..kits.text import ModelKit

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


def _draft_path(kit: ModelKit, path: str | Path) -> Path:
    """Where a draft's files are: ``"mtp"`` names the target's own checkpoint
    (its MTP head), anything else is resolved as a model path."""
    if path == heads.OWN_MTP:
        return heads.own_mtp_path(kit)
    return loading.resolve_model_path(path, "draft model path")


def check_draft_model(kit: ModelKit, path: str | Path) -> DraftCompatibility:
    """Check a draft model against a kit reading only the draft's config and
    tokenizer (no weights), so hosts can list compatible drafts cheaply."""
    reasons: list[str] = []
    try:
        draft_path = _draft_path(kit, path)
        if (head := heads.read_head_config(draft_path)) is not None:
            return heads.check_head(kit, draft_path, head)
        config = loading.read_config(draft_path)
        if loading.is_vision_config(config):
            reasons.append("the draft is a vision model; a draft must be a text-only model")
        loading.check_architecture(config, draft_path)
        draft_tok = loading.load_tokenizer(draft_path)
    except (ModelLoadError, ValueError) as exc:
        return DraftCompatibility(False, [str(exc)])
    main_rows = kit.vocab_size
    vocab_reasons, notes = _compare_vocabularies(kit.tokenizer, draft_tok, main_rows)
    reasons += vocab_reasons
    notes += _special_notes(kit.tokenizer, draft_tok, main_rows, config.get("vocab_size"))
    try:
        if why := _rewind_reason(config):
            reasons.append(f"the draft architecture {config['model_type']!r} cannot rewind its cache: {why}")
    except Exception as exc:  # a config mlx-lm cannot build a model from
        reasons.append(f"could not inspect the draft architecture: {exc}")
    return DraftCompatibility(not reasons, reasons, notes)


def load_draft(kit: ModelKit, path: str | Path) -> None:
    """Load a draft model into the kit, replacing any loaded one only once the
    new one has loaded: a failure leaves the previous draft in place. A path
    that is not there is a ``ModelLoadError`` (not found), not an incompatibility."""
    draft_path = _draft_path(kit, path)
    report = check_draft_model(kit, path)
    if not report:
        raise IncompatibleDraftModelError(
            f"draft model {str(path)!r} is not compatible: " + "; ".join(report.reasons), report.reasons
        )
    for note in report.notes:
        logger.info("draft model %s: %s", path, note)
    if (head := heads.read_head_config(draft_path)) is not None:
        new = heads.load_head(kit, draft_path, head)
        unload_draft(kit)
        new.attach(kit.model)
        kit.set_draft(new)
        logger.info("loaded %s %s (%.1fM parameters)", new.description, draft_path, new.num_params / 1e6)
        return
    model, _ = loading.load_weights(draft_path, trust_remote_code=False)
    loading.prepare_weights(model, "auto")
    loading.smoke_test(model, draft_path)
    new = DraftModel(draft_path, model, kit.new_cache(model), loading.float_param_count(model))
    unload_draft(kit)
    kit.set_draft(new)
    logger.info("loaded draft model %s (%.1fM parameters)", draft_path, kit.draft.num_params / 1e6)


def unload_draft(kit: ModelKit) -> None:
    """Drop the draft model and its cache; the main cache is kept."""
    if kit.draft is None:
        return
    close = getattr(kit.draft, "close", None)
    if close is not None:  # a head: the target's recording modules back to their classes
        close()
    kit.set_draft(None)
    gc.collect()
    mx.clear_cache()
    logger.info("draft model unloaded")
