"""How a host loads a model (``LoadOptions``) and when it unloads them (``HostLimits``)."""

from __future__ import annotations

from mlx_engine import physical_memory

from dataclasses import dataclass, replace

DEFAULT_TTL_S = 3600.0  # an idle model is unloaded after an hour, as LM Studio's just-in-time loads
DEFAULT_MEMORY_SHARE = 0.5  # of physical memory, for the weights of loaded models
DEFAULT_LOAD_WAIT_S = 60.0
RESCAN_INTERVAL_S = 1.0  # an unknown model name rescans the folders at most this often
PAIRED = "paired"  # LoadOptions.draft: the catalog's draft for the model, when it has one
_COMPUTE_DTYPES = ("auto", "native", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded: ``load_model``'s ``max_kv_size`` (``context``),
    ``max_parallel``, ``compute_dtype`` and ``prompt_cache_dir``; ``draft``: a
    catalog name, a path or another known model's id, ``PAIRED`` (the catalog's
    pairing) or None; ``ttl``: idle seconds before an unload (None: the host's)."""

    context: int | str | None = None
    max_parallel: int = 4
    compute_dtype: str = "auto"
    draft: str | None = PAIRED
    ttl: float | None = None
    prompt_cache_dir: str | None = None

    def __post_init__(self) -> None:
        c = self.context
        if not (c is None or c == "auto" or (isinstance(c, int) and not isinstance(c, bool) and c >= 8)):
            raise ValueError(f"context must be an integer >= 8, 'auto' or None, got {c!r}")
        p = self.max_parallel
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 64:
            raise ValueError(f"max_parallel must be an integer from 1 to 64, got {p!r}")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(_COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        check_ttl(self.ttl)


def check_ttl(ttl) -> None:
    """``ValueError`` unless ``ttl`` is None or a positive number of seconds."""
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
        raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")


@dataclass(frozen=True)
class HostLimits:
    """When models are unloaded: ``ttl`` idle seconds (None: never),
    ``memory_bytes`` for loaded models (None: ``DEFAULT_MEMORY_SHARE`` of
    physical memory), ``max_loaded`` (None: no count limit); ``load_wait_s``:
    how long a request waits for a loading model before a 503;
    ``rescan_interval_s``: how often an unknown name may rescan the folders."""

    ttl: float | None = DEFAULT_TTL_S
    memory_bytes: int | None = None
    max_loaded: int | None = None
    load_wait_s: float = DEFAULT_LOAD_WAIT_S
    rescan_interval_s: float = RESCAN_INTERVAL_S

    def __post_init__(self) -> None:
        check_ttl(self.ttl)
        for name in ("memory_bytes", "max_loaded"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if not self.load_wait_s > 0:
            raise ValueError(f"load_wait_s must be positive, got {self.load_wait_s!r}")

    @property
    def budget(self) -> int:
        return self.memory_bytes if self.memory_bytes is not None else int(DEFAULT_MEMORY_SHARE * physical_memory())


def replace_options(options: LoadOptions, **changes) -> LoadOptions:
    """``options`` with ``changes`` (checked: ``ValueError`` naming the field)."""
    return replace(options, **changes)
