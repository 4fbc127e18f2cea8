"""Embeddings: ``load_embedding_model`` (or ``load_model`` on a model in
sentence-transformers' layout) and ``embed`` (docs/api.md, "Embeddings")."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError
from ..loading import model as loading
from ..runtime import worker
from .config import POOLINGS, EmbeddingConfig, EmbeddingOverrides, is_embedding_model
from .kit import (
    DEFAULT_BATCH_SIZE,
    EmbeddingKit,
    Embeddings,
    check_batch_size,
    check_dimensions,
    load_embedding_kit,
    run_batches,
    tokenize_inputs,
)

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "POOLINGS",
    "EmbeddingConfig",
    "EmbeddingKit",
    "Embeddings",
    "embed",
    "is_embedding_model",
    "load_embedding_model",
    "on_engine_thread",
]


def load_embedding_model(
    model_path: str | Path,
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_length: int | None = None,
    matryoshka: bool | None = None,
    compute_dtype: str | None = "auto",
    trust_remote_code: bool = False,
) -> EmbeddingKit:
    """Load an embedding model (a directory or a catalog name) into an ``EmbeddingKit``.

    How it pools and normalizes comes from the model's sentence-transformers
    files (``modules.json``, ``1_Pooling/config.json``); each argument that is
    not None overrides them, so a model without those files (a plain BERT, a
    decoder to pool at its last token) can be used too: ``pooling`` is one of
    ``POOLINGS``, ``max_length`` bounds the tokens of one input, ``matryoshka``
    allows ``embed(..., dimensions=N)``. BERT-family encoders run in this
    package's MLX BERT; other architectures load through mlx-lm as decoders."""
    path = loading.resolve_model_path(model_path)
    if not path.is_dir():
        raise ModelLoadError(f"model_path {str(path)!r}: embedding models load from a model directory")
    overrides = EmbeddingOverrides(pooling, normalize, max_length, matryoshka)
    return on_engine_thread(
        load_embedding_kit, path, overrides, compute_dtype=compute_dtype, trust_remote_code=trust_remote_code
    )


def on_engine_thread(build, *args, **kwargs) -> EmbeddingKit:
    """``build(*args, worker=thread, **kwargs)`` on an engine thread, given to the
    kit it builds, which that thread then serves."""
    thread = worker.acquire()
    try:
        kit = thread.call(build, *args, worker=thread, **kwargs)
    except BaseException:
        worker.release(thread)
        raise
    worker.release_with(kit, thread)
    return kit


def embed(
    kit: EmbeddingKit,
    texts: str | list,
    *,
    truncate: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dimensions: int | None = None,
) -> Embeddings:
    """The embeddings of ``texts``: a string, or a non-empty list of strings and
    token-id lists (ids taken as the model's whole input, as ``tokenize`` gives
    them), one vector per input, pooled and normalized as the model says.

    An input over the model's ``max_length`` tokens raises ``ValueError``
    naming it (``texts[i]``) unless ``truncate=True``, which embeds its first
    tokens (``Embeddings.truncated`` tells which were cut). ``batch_size``:
    inputs per forward pass. ``dimensions``: keep the first N dimensions
    (renormalized), on a model trained for it (``kit.config.matryoshka``)."""
    if not isinstance(kit, EmbeddingKit):
        raise ValueError(f"kit must be an EmbeddingKit (an embedding model), got {type(kit).__name__}")
    batch = tokenize_inputs(kit, texts, truncate)  # the tokenizer runs on the caller's thread
    dims = check_dimensions(kit, dimensions)
    size = check_batch_size(batch_size)
    vectors = kit.worker.call(run_batches, kit, batch.ids, size, dims)
    return Embeddings(vectors, tuple(len(r) for r in batch.ids), tuple(batch.truncated))
