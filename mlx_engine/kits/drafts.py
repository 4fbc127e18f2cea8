"""A kit's drafter slot: check a draft (a separate draft model, or a hidden-state
head) against the kit, load it in and unload it. The files are read by
``draft/loading.py`` (draft models) and ``heads/loading.py`` (heads); the kit
only holds what they built (``ModelKit.set_draft``)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import mlx.core as mx

from ..draft.loading import DraftCompatibility, check_draft_files, load_draft_files
from ..errors import IncompatibleDraftModelError
from ..heads import loading as heads
from ..loading import model as loading
from .text import ModelKit

logger = logging.getLogger(__name__)


def _draft_path(kit: ModelKit, path: str | Path) -> Path:
    """Where a draft's files are: ``"mtp"`` names the target's own checkpoint
    (its MTP head), anything else is resolved as a model path."""
    if path == heads.OWN_MTP:
        return heads.own_mtp_path(kit)
    return loading.resolve_model_path(path, "draft model path")


def _head_refusal(kit: ModelKit) -> str | None:
    """Why this kit cannot feed a hidden-state head (a vision kit's language
    model is wrapped by mlx-vlm), or None."""
    if type(kit) is not ModelKit:
        return f"hidden-state heads are supported on text kits, not on a {type(kit).__name__}"
    return None


def check_draft_model(kit: ModelKit, path: str | Path) -> DraftCompatibility:
    """Check a draft model against a kit reading only the draft's config and
    tokenizer (no weights), so hosts can list compatible drafts cheaply."""
    try:
        draft_path = _draft_path(kit, path)
        head = heads.head_config_for(kit, draft_path)
    except ValueError as exc:  # ModelLoadError is a ValueError
        return DraftCompatibility(False, [str(exc)])
    if head is not None:
        return heads.check_head(kit, draft_path, head, refusal=_head_refusal(kit))
    return check_draft_files(kit.tokenizer, kit.vocab_size, draft_path)


def load_draft(kit: ModelKit, path: str | Path, name: str | None = None) -> None:
    """Load a draft model into the kit, replacing any loaded one only once the
    new one has loaded: a failure leaves the previous draft in place. A path
    that is not there is a ``ModelLoadError`` (not found), not an incompatibility.
    ``name``: what the kit calls it (``path`` as given by default)."""
    name = str(path) if name is None else name
    draft_path = _draft_path(kit, path)
    report = check_draft_model(kit, path)
    if not report:
        raise IncompatibleDraftModelError(
            f"draft model {str(path)!r} is not compatible: " + "; ".join(report.reasons), report.reasons
        )
    for note in report.notes:
        logger.info("draft model %s: %s", path, note)
    if (head := heads.head_config_for(kit, draft_path)) is not None:
        new = heads.load_head(kit, draft_path, head)
        unload_draft(kit)
        new.attach(kit.model)
        kit.set_draft(new, name)
        logger.info("loaded %s %s (%.1fM parameters)", new.description, draft_path, new.num_params / 1e6)
        return
    new = load_draft_files(draft_path, kit.new_cache)
    unload_draft(kit)
    kit.set_draft(new, name)
    logger.info("loaded draft model %s (%.1fM parameters)", draft_path, new.num_params / 1e6)


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
