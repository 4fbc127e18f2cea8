"""Sharded kits: one model split over the processes of an ``mx.distributed`` group
(docs/distributed.md).

Every rank calls ``load_sharded_model`` with the same arguments. Rank 0 gets a
``ShardedModelKit``, a ``ModelKit`` that the whole API accepts (generators,
stats, cancellation, prompt cache, draft models, prompt lookup, the auto
router); the other ranks get a ``Follower`` whose ``serve()`` mirrors rank 0's
forward passes until rank 0 unloads the kit (protocol.py). The draft model and
prompt lookup run on rank 0 only: the followers see verify passes, not drafts.
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import logging
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from .. import loading, worker
from ..errors import DistributedConfigError, ShardedKitError
from ..cache import CacheOptions
from ..model_kit import KitOptions, ModelKit, materialize, param_count
from ..request import WhenIdle
from . import sharding
from .control import ControlClient, ControlServer, break_ring_sockets, rank0_host
from .protocol import FollowerExit, FollowerLoop, MirroredModel, PassCounter

__all__ = ["Follower", "FollowerExit", "ShardInfo", "ShardedModelKit", "load_sharded_model"]

logger = logging.getLogger(__name__)

ABORT_GRACE = 5.0  # seconds a failed rank's blocked call gets to end before the host is released anyway
EXIT_STOP_WAIT = 10.0


@dataclass(frozen=True)
class ShardInfo:
    """Where this process stands in the sharded job."""

    rank: int
    size: int
    parallelism: str  # "tensor" or "pipeline"
    counter: PassCounter  # forward passes (and their tokens) mirrored by rank 0


class _Health:
    """Whether the job is usable; the first failure wins."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self._lock = threading.Lock()

    def fail(self, reason: str) -> bool:
        with self._lock:
            if self.failure is not None:
                return False
            self.failure = reason
            return True

    def error(self) -> ShardedKitError:
        return ShardedKitError(
            f"the sharded kit is unusable: {self.failure}. Relaunch the job (every rank) and load the model again"
        )


class ShardWorker(worker.MLXWorker):
    """The engine thread of one rank. A failure of the job (a rank died or hung,
    noticed by MLX or by the control channel) turns into ``ShardedKitError`` for
    the call that was running and every later one."""

    def __init__(self, health: _Health):
        super().__init__()
        self.health = health
        self.on_ring_error: Callable[[str], None] = health.fail
        self.release: Callable | None = None  # runs inline once failed (unloading a dead kit)
        self.on_abort: Callable[[], None] | None = None  # after abort_inflight released a blocked call
        self._inflight: list[worker.Task] = []

    def submit(self, fn: Callable, *args, **kwargs) -> worker.Task:
        if self.health.failure is not None:
            # unload() runs the kit's release either directly or through the
            # API's idle check (a WhenIdle carrying it).
            releasing = self.release is not None and (
                fn == self.release or (isinstance(fn, WhenIdle) and fn.action == self.release))
            if releasing or _closes_generator(fn):
                # Unloading a dead kit or closing its generators touches no rank: run it here.
                task = worker.Task(fn, args, kwargs)
                task.run()
                if task.error is not None and _closes_generator(fn):
                    task.error = None  # a generator still running on a blocked thread stays as it is
                return task
            raise self.health.error()
        task = super().submit(self._guarded, fn, args, kwargs)
        self._inflight = [t for t in self._inflight if not t.done.is_set()] + [task]
        return task

    def _guarded(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            if isinstance(exc, ShardedKitError) or (self.health.failure is None and "[ring]" not in str(exc)):
                raise
            self.on_ring_error(f"MLX reported: {exc}")
            raise self.health.error() from exc

    def abort_inflight(self) -> None:
        """Release the host from calls still blocked after a failure (their thread
        stays blocked inside MLX; the kit is not used again)."""
        aborted = False
        for task in self._inflight:
            if not task.done.is_set():
                task.error = self.health.error()
                task.done.set()
                aborted = True
        if aborted and self.on_abort is not None:
            self.on_abort()

    def run_at_exit(self, fn: Callable, timeout: float) -> None:
        task = worker.Task(fn, (), {})
        self._tasks.put(task)  # submit() refuses work once the process is exiting
        task.done.wait(timeout)


def _closes_generator(fn: Callable) -> bool:
    return getattr(fn, "__name__", "") == "close" and inspect.isgenerator(getattr(fn, "__self__", None))


def _on_failure(health: _Health, thread: ShardWorker, reason: str, control) -> None:
    """A rank failed: record it, release collectives blocked on it, and give the
    host its error within ABORT_GRACE seconds whatever MLX does."""
    if not health.fail(reason):
        return
    broken = break_ring_sockets()
    logger.error("sharded kit failed: %s (%d ring sockets shut down)", reason, broken)
    if control is not None:
        control.close()
    timer = threading.Timer(ABORT_GRACE, thread.abort_inflight)
    timer.daemon = True
    timer.start()


class ShardedModelKit(ModelKit):
    """Rank 0's kit over a model sharded across the job; use it like any ModelKit.
    ``usable`` is False (and every call raises ``ShardedKitError``) once a rank
    has failed; ``unload`` releases the followers."""

    shard: ShardInfo

    def _attach(self, model: MirroredModel, info: ShardInfo, num_params: int, compute_dtype, health: _Health,
                control: ControlServer) -> None:
        self.vocab_only = False
        self.model = model
        self.num_params = num_params  # of the whole model, as for a ModelKit
        self.compute_dtype = compute_dtype
        self.cache = self.new_cache(model)
        # The followers mirror in-place trims of each cache, not branches of one
        # cache into another, so this kit keeps a single cached sequence.
        self.prompt_cache.single_sequence = True
        self.shard = info
        self._health = health
        self._control = control

    def _forget_generation(self) -> None:
        """The generation that was running is blocked on a failed rank and will never
        finish on its own: stop counting it, so that ``unload`` is allowed."""
        act = self._activity
        with act.lock:
            act.active.clear()
            act.known.clear()
            act.cancelled.clear()

    @property
    def usable(self) -> bool:
        return self._health.failure is None and self.model is not None

    @property
    def failure(self) -> str | None:
        """Why the kit is unusable (None while it is usable)."""
        return self._health.failure

    def unload(self) -> None:
        """Release the followers and drop the model. After a failure this runs on the
        calling thread and only drops references: MLX calls such as ``clear_cache``
        can wait on the engine thread, which may be blocked on the failed rank."""
        model = self.model
        failed = self._health.failure is not None
        if isinstance(model, MirroredModel) and not failed:
            self._control.closing()
            try:
                model.stop_followers()
            except RuntimeError as exc:
                logger.warning("could not release the followers: %s", exc)
        self._control.close()
        if not failed:
            super().unload()
            return
        self.model = self.cache = self.draft = self.cost_model = None


class Follower:
    """A rank other than 0: ``serve()`` mirrors rank 0's passes until it unloads
    the kit (``FollowerExit("stopped")``) or the job fails (``"failed"``)."""

    def __init__(self, loop: FollowerLoop, info: ShardInfo, thread: ShardWorker, control: ControlClient):
        self._loop = loop
        self.shard = info
        self._thread = thread
        self._control = control
        self._stopped = False

    def serve(self) -> FollowerExit:
        try:
            result = self._thread.call(self._loop.run)
        except (RuntimeError, ShardedKitError) as exc:
            result = FollowerExit("failed", self._loop.passes, str(exc), len(self._loop.caches))
        self._stopped = True
        self._control.close()
        logger.info("follower rank %d: %s after %d passes %s", self.shard.rank, result.reason, result.passes, result.detail)
        return result

    def _lost_rank0(self) -> None:
        time.sleep(0.5)  # rank 0 closes the channel right after its stop message: let serve() see that first
        if not (self._stopped or self._loop.stopped):
            _on_failure(self._thread.health, self._thread, "rank 0 closed the control connection", None)


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
    health = _Health()
    thread = ShardWorker(health)
    options = dict(max_kv_size=max_kv_size, trust_remote_code=trust_remote_code, seed=seed, compute_dtype=compute_dtype,
                   parallelism=parallelism, verify_weights=verify_weights, heartbeat_timeout=float(heartbeat_timeout),
                   connect_timeout=float(connect_timeout), control_host=control_host)
    try:
        result = thread.call(_load, model_path, health, thread, **options)
    except ShardedKitError as exc:  # a rank died (MLX: connection lost) or hung (control channel) during the load
        reason = health.failure or exc.__cause__ or exc
        raise DistributedConfigError(f"a rank failed while the model was loading: {reason}") from exc
    if isinstance(result, ShardedModelKit):
        result.attach_worker(thread)
        thread.release = result.unload
        thread.on_abort = result._forget_generation
        atexit.register(_release_at_exit, weakref.ref(result))
    return result


def _load(model_path, health: _Health, thread: ShardWorker, **opts) -> ShardedModelKit | Follower:
    group = mx.distributed.init()
    if group.size() < 2:
        raise DistributedConfigError(
            "a sharded kit needs at least 2 processes, and this one is alone in its mx.distributed group; start every "
            "rank with mlx.launch (e.g. mlx.launch -n 2 --backend ring script.py) or use load_model for one process"
        )
    # The control channel comes first, so that every later step of the load
    # (reading and hashing files, reading the shard, the test pass) is watched
    # by the heartbeats; the collectives before it are bounded by a watchdog.
    control = _open_control(group, health, thread, opts)
    path, config = _check_files(model_path, group, opts)
    model, info, dtype, num_params = _load_shard(path, config, group, opts)
    if opts["seed"] is not None:
        mx.random.seed(opts["seed"])
    if info.rank == 0:
        options = KitOptions(CacheOptions.validate(opts["max_kv_size"]), vocab_only=True,
                             trust_remote_code=opts["trust_remote_code"])
        kit = ShardedModelKit(path, options)
        mirrored = MirroredModel(model, group)
        kit._attach(mirrored, ShardInfo(0, group.size(), info.parallelism, mirrored.counter), num_params, dtype, health, control)
        logger.info("sharded kit: %s over %d ranks (%s-parallel)", path, group.size(), info.parallelism)
        return kit
    follower = Follower(FollowerLoop(model, group), info, thread, control)
    control.on_lost = follower._lost_rank0
    return follower


def _open_control(group, health: _Health, thread: ShardWorker, opts) -> ControlServer | ControlClient:
    """Connect the control channel and start watching it: rank 0's monitor
    (a follower that exits or stops beating fails the load or the kit), a
    follower's heartbeats. Until it is up, a watchdog breaks the ring sockets
    after ``connect_timeout`` so that no collective waits forever on a stalled rank."""
    # accept() waits up to connect_timeout itself and reports who is missing; the
    # watchdog catches what it cannot (a collective around it that never returns).
    watchdog = threading.Timer(opts["connect_timeout"] + ABORT_GRACE, _on_failure,
                               (health, thread, f"a rank did not join the control channel within "
                                                f"{opts['connect_timeout']:g} s (connect_timeout): it is hung or stopped", None))
    watchdog.daemon = True
    watchdog.start()
    try:
        if group.rank() == 0:
            control = _serve_control(group, opts)
            thread.on_ring_error = lambda reason: _on_failure(health, thread, reason, control)
            control.watch(lambda reason: _on_failure(health, thread, reason, control))
        else:
            control = _join_control(group, opts)
            control.start(lambda: _on_failure(health, thread, "rank 0 closed the control connection", None))
    finally:
        watchdog.cancel()
    return control


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
        num_params = param_count(model)  # shapes only: nothing is read yet
        parallelism = sharding.choose_parallelism(model, config, group.size(), opts["parallelism"])
        dtype = loading.choose_compute_dtype(model, opts["compute_dtype"])
        sharding.cast_lazily(model, dtype)
        sharding.shard(model, group, parallelism)
        materialize(model)
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


def _serve_control(group, opts) -> ControlServer:
    """Rank 0: open the control channel and wait for every follower to join."""
    error, server, token = None, None, secrets.randbits(62)
    try:
        host = opts["control_host"] or rank0_host()
        if not host:
            raise DistributedConfigError("no ring hostfile (MLX_HOSTFILE) to find rank 0's address in; pass control_host")
        server = ControlServer(host, group.size() - 1, token, opts["heartbeat_timeout"])
    except (OSError, ValueError) as exc:
        error = f"cannot open the control channel: {exc}"
    port = server.port if server else 0
    mx.eval(mx.distributed.all_sum(mx.array([port, token >> 31, token & (2**31 - 1)], dtype=mx.int32), group=group))
    if server is not None:
        try:
            server.accept(opts["connect_timeout"])
        except (OSError, ValueError) as exc:
            error = str(exc)
    sharding.agree(group, "connecting the control channel", error)
    return server


def _join_control(group, opts) -> ControlClient:
    """A follower: connect to rank 0's control channel."""
    port, high, low = mx.distributed.all_sum(mx.zeros((3,), dtype=mx.int32), group=group).tolist()
    error, client = None, None
    if port:
        try:
            host = opts["control_host"] or rank0_host() or ""
            client = ControlClient(host, port, (high << 31) | low, group.rank(), opts["connect_timeout"])
        except (OSError, ValueError) as exc:
            error = str(exc)
    else:
        error = "rank 0 opened no control channel"
    sharding.agree(group, "connecting the control channel", error)
    return client


def _release_at_exit(ref: "weakref.ref[ShardedModelKit]") -> None:
    """At process exit, release the followers of a kit that is still loaded."""
    kit = ref()
    if kit is None or not kit.usable or kit.model is None:
        return
    worker.shutting_down.set()  # a running generation stops at its next token
    kit.worker.run_at_exit(kit.unload, EXIT_STOP_WAIT)
