"""Memory facts in one place: physical and available memory, the prompt cache's
default budget, and fitting the context (``max_kv_size="auto"``) and the prefill
chunk to memory.

A full-attention KV cache costs the same bytes for every token it holds, so the
longest context that fits is the memory left for caches divided by the bytes per
token. ``fit_context`` takes half of the memory available at load (after the
weights are in), and never more than the model was trained for. The prefill chunk
is the other big allocation: a chunk's logits alone are chunk × vocabulary
floats, so ``prefill_chunk`` halves the chunk while it would take more than a
quarter of the available memory.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

logger = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per forward pass, before fitting to memory
MIN_PREFILL_CHUNK = 32
CONTEXT_MEMORY_SHARE = 0.5


def physical_memory() -> int:
    """Bytes of physical memory (16 GiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 2**30


def default_memory_budget() -> int:
    """The prompt cache's default byte budget: an eighth of physical memory, at most 4 GiB."""
    return min(4 * 2**30, physical_memory() // 8)


def available_memory() -> int:
    """Bytes the OS could give this process now (MemAvailable), or physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


def return_freed_memory() -> None:
    """Hand what a load freed back to the OS: MLX's buffer cache, then the C
    heap's free pages (glibc's ``malloc_trim``; elsewhere only the cache). A
    load decodes weights through transient buffers (a GGUF file's blocks,
    re-quantization) that glibc would keep: a freshly loaded quantized MoE
    file's resident memory read 1.8x the file instead of 1.09x
    (bench/gguf_moe_rss.py)."""
    import ctypes
    import gc

    gc.collect()  # the load's last references (a weights dict in a cycle) ...
    mx.clear_cache()  # ... and MLX's buffer cache go back to the heap first
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to hand back this way
        return
    libc.malloc_trim(0)


def kv_bytes_per_token(model: nn.Module) -> int:
    """KV bytes one cached token costs, measured by caching one token."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array):
            total += (keys.nbytes // keys.shape[2]) + (values.nbytes // values.shape[2])
    return max(total, 1)


def fit_context(model: nn.Module, trained_context: int | None) -> int:
    """The longest context whose KV cache fits CONTEXT_MEMORY_SHARE of the
    memory available now, capped at the context the model was trained for."""
    per_token = kv_bytes_per_token(model)
    fits = int(CONTEXT_MEMORY_SHARE * available_memory()) // per_token
    context = min(fits, trained_context) if trained_context else fits
    logger.info(
        "context fitted to memory: %d tokens (%d KV bytes per token; trained for %s)",
        context,
        per_token,
        trained_context,
    )
    return max(context, 8)


def prefill_chunk(vocab_size: int, hidden_size: int) -> int:
    """PREFILL_CHUNK, halved while a chunk's activations (its logits dominate)
    would take more than a quarter of the memory available now."""
    budget = available_memory() // 4
    chunk = PREFILL_CHUNK
    while chunk > MIN_PREFILL_CHUNK and chunk * (vocab_size + 16 * hidden_size) * 4 > budget:
        chunk //= 2
    return chunk
