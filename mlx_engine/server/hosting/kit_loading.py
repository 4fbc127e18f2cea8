"""A known model loaded as a kit (with its draft) and freed again, and the load
errors a client gets: a model over the memory budget, a draft that cannot serve it."""

from __future__ import annotations

import mlx_engine as me
from mlx_engine import catalog

import gc
import logging
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..web.errors import APIError
from .discovery import KnownModel
from .options import PAIRED, LoadOptions
from .templates import give_template

logger = logging.getLogger(__name__)


def model_too_large(model_id: str, size: int, budget: int) -> APIError:
    """A model that cannot fit the whole memory budget even with nothing else
    loaded: a client error (4xx, which SDKs do not retry), naming both sizes."""
    return APIError(
        400,
        f"model {model_id!r} needs about {size / 2**30:.2f} GiB ({size} bytes of weights), more than the "
        f"server's whole memory budget of {budget / 2**30:.2f} GiB ({budget} bytes); it cannot be loaded "
        "here unless the server is started with a larger --memory-budget",
        param="model",
        code="model_too_large",
    )


def scrubbed(message: str, model: KnownModel) -> str:
    """``message`` with the model's path on this machine said as its id: load
    errors go to clients, the server's folders do not."""
    for path in (model.source, str(Path(model.source).parent)):
        if len(path) > 1 and model.kind != "catalog":
            message = message.replace(path, model.id)
    return message


def bad_draft(draft: str, model_id: str, reasons: list[str], source: str) -> APIError:
    """A 400 naming ``draft``: the draft cannot serve the model; said with the
    name the client gave (the server's own paths left out)."""
    why = "; ".join(r.replace(source, draft) for r in reasons)
    return APIError(
        400,
        f"draft: {draft!r} cannot serve model {model_id!r}: {why}",
        param="draft",
        code="incompatible_draft_model",
    )


def free_kit(kit: me.ModelKit) -> None:
    """``unload`` (which writes the prompt cache's disk tier), then collect the
    reference cycles that ended generations leave (frames, tracebacks): they can
    hold the model's arrays until Python's next full collection, and the memory
    should be back when the unload returns."""
    me.unload(kit)
    gc.collect()
    mx.clear_cache()


def load_kit(model: KnownModel, options: LoadOptions, draft_source: Callable[[str], str]) -> me.ModelKit:
    """The host's default loader (on a thread): ``load_model`` and the draft;
    ``draft_source``: where a draft name is loaded from."""
    kit = me.load_model(
        model.source,
        max_kv_size=options.context,
        compute_dtype=options.compute_dtype,
        max_parallel=options.max_parallel,
        prompt_cache_dir=options.prompt_cache_dir,
    )
    if isinstance(kit, me.EmbeddingKit):  # (load_model gives one for sentence-transformers' layout) no draft
        return kit
    give_template(kit, model.id)  # ChatML for a model without a template of its own
    draft = draft_of(model, options)
    try:
        if draft is not None:
            me.load_draft_model(kit, draft_source(draft), name=draft)
    except Exception as exc:
        if options.draft == PAIRED:  # the pairing is a bonus: serve without it
            logger.warning("model %s: its paired draft %s did not load", model.id, draft, exc_info=True)
        else:
            me.unload(kit)
            if isinstance(exc, ValueError):  # IncompatibleDraftModelError, ModelLoadError: the request's draft
                raise bad_draft(draft, model.id, [str(exc)], draft_source(draft)) from None
            raise
    return kit


def check_draft(kit: me.ModelKit, model: KnownModel, options: LoadOptions, draft_source: Callable[[str], str]) -> None:
    """400 naming ``draft`` when the draft ``options`` name explicitly cannot
    serve ``kit`` (its config and tokenizer read, no weights): on a thread."""
    if options.draft in (None, PAIRED):
        return
    source = draft_source(options.draft)
    report = me.check_draft_model(kit, source)
    if not report.compatible:
        raise bad_draft(options.draft, model.id, report.reasons, source)


def draft_of(model: KnownModel, options: LoadOptions) -> str | None:
    """The draft ``options`` name for ``model`` (the catalog's pairing for ``PAIRED``)."""
    return catalog.draft_for(model.source) if options.draft == PAIRED else options.draft
