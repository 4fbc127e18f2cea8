"""``load_sharded_model``: every rank loads its shard of one model, agreeing
with the others at each step (files, shards, a test pass) before it returns
rank 0's kit or a follower."""

from __future__ import annotations

import atexit
import hashlib
import logging
import weakref
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..caches.sequence import CacheOptions
from ..errors import DistributedConfigError, ShardedKitError
from ..kits.text import KitOptions
from ..loading import model as loading
from . import sharding
from .connect import open_control
from .follower import Follower
from .health import Health, ShardWorker
from .kit import Shard, ShardedModelKit, ShardInfo, release_at_exit
from .protocol import FollowerLoop, MirroredModel, PassCounter

logger = logging.getLogger(__name__)


def load_sharded_model(
    model_path: str | Path,
    *,
    max_kv_size: int | None = None,
    trust_remote_code: bool = False,
    seed: int | None = None,
    compute_dtype: str | None = "auto",
    parallelism: str = "auto",
    verify_weights: str = "sampled",
    heartbeat_timeout: float = 10.0,
    connect_timeout: float = 60.0,
    control_host: str | None = None,
) -> ShardedModelKit | Follower:
    """Load this rank's shard of ``model_path``; call it on every rank of the job
    (started with ``mlx.launch``) with the same arguments. Returns a
    ``ShardedModelKit`` on rank 0 and a ``Follower`` elsewhere.

    ``parallelism``: "auto" (tensor-parallel where mlx-lm's model has ``shard()``
    and the head and MLP sizes divide by the rank count, else pipeline),
    "tensor" or "pipeline". ``verify_weights``: "sampled" or "full" hashing of the
    model files, compared across ranks. ``heartbeat_timeout``: seconds of silence
    after which a rank counts as hung. ``control_host``: rank 0's address for the
    control channel (default: from the ring hostfile). Bad configurations raise
    ``DistributedConfigError`` on every rank (docs/distributed.md)."""
    if parallelism not in ("auto", "tensor", "pipeline"):
        raise ValueError(f"parallelism must be 'auto', 'tensor' or 'pipeline', got {parallelism!r}")
    if verify_weights not in ("sampled", "full"):
        raise ValueError(f"verify_weights must be 'sampled' or 'full', got {verify_weights!r}")
    for name, value in (("heartbeat_timeout", heartbeat_timeout), ("connect_timeout", connect_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value <= 3600.0:
            raise ValueError(f"{name} must be a number of seconds from 1 to 3600, got {value!r}")
    health = Health()
    thread = ShardWorker(health)
    options = dict(
        max_kv_size=max_kv_size,
        trust_remote_code=trust_remote_code,
        seed=seed,
        compute_dtype=compute_dtype,
        parallelism=parallelism,
        verify_weights=verify_weights,
        heartbeat_timeout=float(heartbeat_timeout),
        connect_timeout=float(connect_timeout),
        control_host=control_host,
    )
    try:
        result = thread.call(_load, model_path, health, thread, **options)
    except ShardedKitError as exc:  # a rank died (MLX: connection lost) or hung (control channel) during the load
        reason = health.failure or exc.__cause__ or exc
        raise DistributedConfigError(f"a rank failed while the model was loading: {reason}") from exc
    if isinstance(result, ShardedModelKit):
        thread.serve_kit(result.unload, result.forget_generation)
        atexit.register(release_at_exit, weakref.ref(result))
    return result


def _load(model_path, health: Health, thread: ShardWorker, **opts) -> ShardedModelKit | Follower:
    group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedConfigError(
            "a sharded kit needs at least 2 processes, and this one is alone in its mx.distributed group; start every "
            "rank with mlx.launch (e.g. mlx.launch -n 2 --backend ring script.py) or use load_model for one process"
        )
    # The control channel comes first, so that every later step of the load
    # (reading and hashing files, reading the shard, the test pass) is watched
    # by the heartbeats; the collectives before it are bounded by a watchdog.
    control = open_control(group, health, thread, opts)
    path, config = _check_files(model_path, group, opts)
    model, info, dtype, num_params = _load_shard(path, config, group, opts)
    if opts["seed"] is not None:
        mx.random.seed(opts["seed"])
    if info.rank == 0:
        options = KitOptions(
            CacheOptions.validate(opts["max_kv_size"]), vocab_only=True, trust_remote_code=opts["trust_remote_code"]
        )
        mirrored = MirroredModel(model, group)
        shard = Shard(
            mirrored, ShardInfo(0, group.size(), info.parallelism, mirrored.counter), num_params, dtype, health, control
        )
        kit = ShardedModelKit(path, options, shard, thread)
        logger.info("sharded kit: %s over %d ranks (%s-parallel)", path, group.size(), info.parallelism)
        return kit
    follower = Follower(FollowerLoop(model, group), info, thread, control)
    control.redirect(follower.lost_rank0)
    return follower


def _check_files(model_path, group, opts) -> tuple[Path, dict]:
    """Resolve and read the model on every rank; all ranks must have the same files and settings."""
    error, digest, path, config = None, b"", None, None
    try:
        if CacheOptions.validate(opts["max_kv_size"]).auto_context:
            raise ValueError("max_kv_size='auto' is not supported for sharded kits; pass a number of tokens or None")
        path = loading.resolve_model_path(model_path)
        config = loading.read_config(path)
        if loading.is_vision_config(config):
            raise DistributedConfigError("vision models cannot be sharded (text models only)")
        loading.check_architecture(config, path)
        settings = {k: opts[k] for k in ("trust_remote_code", "compute_dtype", "parallelism")}
        digest = sharding.fingerprint(path, full=opts["verify_weights"] == "full") + sharding.settings_digest(settings)
        digest = hashlib.sha256(digest).digest()
    except Exception as exc:
        error = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
    sharding.agree(group, "the model files, load settings or mlx / mlx-lm versions", error, digest)
    return path, config


def _load_shard(path: Path, config: dict, group, opts) -> tuple[Any, ShardInfo, Any, int]:
    """Load, cast and shard the model, then run one token through it on every rank.
    A local failure of any kind is reported through ``agree`` (never raised alone)."""
    error, model, parallelism, dtype, num_params = None, None, "", None, 0
    try:
        model, config = sharding.load_lazily(path, opts["trust_remote_code"])
        num_params = loading.float_param_count(model)  # shapes only: nothing is read yet
        parallelism = sharding.choose_parallelism(model, config, group.size(), opts["parallelism"])
        dtype = loading.choose_compute_dtype(model, opts["compute_dtype"])
        sharding.cast_lazily(model, dtype)
        sharding.shard(model, group, parallelism)
        loading.materialize(model)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
    sharding.agree(group, "loading the model shards", error, f"{parallelism}/{dtype}".encode())
    from mlx_lm.models.cache import make_prompt_cache

    error = None
    try:
        logits = model(mx.array([[0]], dtype=mx.uint32), cache=make_prompt_cache(model))
        if not bool(mx.all(mx.isfinite(logits)).item()):
            error = "the sharded model computes NaN or infinite logits"
    except Exception as exc:
        if "[ring]" in str(exc):
            raise DistributedConfigError(f"a rank failed while loading: {exc}") from exc
        error = f"the sharded model cannot run: {type(exc).__name__}: {exc}"
    sharding.agree(group, "running one token through the sharded model", error)
    return model, ShardInfo(group.rank(), group.size(), parallelism, PassCounter()), dtype, num_params
