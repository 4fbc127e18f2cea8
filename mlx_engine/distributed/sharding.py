"""Loading one rank's shard of a model with mlx-lm's sharding, and the checks that
every rank loaded the same thing.

A check that fails on one rank must fail on all of them: a rank that raised
while the others wait in a collective would leave them waiting forever. So each
load step ends in ``agree``: every rank all-gathers its outcome (ok or an error
message) and a digest, and every rank raises the same ``DistributedConfigError``
when any rank failed or the digests differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import DistributedConfigError
from ..loading import model as loading

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_MESSAGE_BYTES = 384
_SAMPLE_BLOCK = 1 << 20
_SAMPLES = 16
_WHOLE_FILE_LIMIT = 16 << 20


@dataclass(frozen=True)
class RankOutcome:
    ok: bool
    digest: bytes
    message: str


def agree(group: mx.distributed.Group, what: str, error: str | None, digest: bytes = b"") -> list[RankOutcome]:
    """All-gather each rank's outcome of a load step; raise the same error on every
    rank if any failed or their digests differ (naming the ranks)."""
    digest = digest.ljust(32, b"\0")[:32]
    message = (error or "").encode("utf-8")[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    local = mx.array([0 if error else 1, *digest, *message], dtype=mx.int32)
    rows = mx.distributed.all_gather(local, group=group).reshape(group.size(), -1).tolist()
    outcomes = [
        RankOutcome(bool(r[0]), bytes(r[1:33]), bytes(r[33:]).rstrip(b"\0").decode("utf-8", "replace")) for r in rows
    ]
    failed = [f"rank {i}: {o.message}" for i, o in enumerate(outcomes) if not o.ok]
    if failed:
        raise DistributedConfigError(f"{what} failed on {len(failed)} of {len(outcomes)} ranks: " + "; ".join(failed))
    if len({o.digest for o in outcomes}) > 1:
        groups: dict[bytes, list[int]] = {}
        for i, o in enumerate(outcomes):
            groups.setdefault(o.digest, []).append(i)
        parts = [f"ranks {ranks} have {d[:6].hex()}" for d, ranks in groups.items()]
        raise DistributedConfigError(
            f"{what} differ between ranks ({'; '.join(parts)}): every rank must load the same model files with the same settings"
        )
    return outcomes


def model_files(path: Path) -> list[Path]:
    """The files a model consists of: the GGUF file, or the directory's regular files."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


def fingerprint(path: Path, full: bool = False) -> bytes:
    """SHA-256 over the model's files: names, sizes and contents; files above 16 MiB
    are sampled (their first and last MiB and 16 blocks between) unless ``full``,
    so checking a 100 GB model takes milliseconds, not minutes."""
    h = hashlib.sha256()
    for file in model_files(path):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            if full or size <= _WHOLE_FILE_LIMIT:
                for block in iter(lambda: f.read(_SAMPLE_BLOCK), b""):
                    h.update(block)
                continue
            step = (size - _SAMPLE_BLOCK) // (_SAMPLES + 1)
            for offset in [0, *(step * i for i in range(1, _SAMPLES + 1)), size - _SAMPLE_BLOCK]:
                f.seek(offset)
                h.update(f.read(_SAMPLE_BLOCK))
    return h.digest()


def settings_digest(settings: dict) -> bytes:
    import mlx_lm

    versions = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "protocol": PROTOCOL_VERSION}
    return hashlib.sha256(json.dumps({**versions, **settings}, sort_keys=True, default=str).encode()).digest()


def shard_support(model: nn.Module) -> tuple[bool, bool]:
    """(tensor-parallel, pipeline-parallel) as mlx-lm's ``sharded_load`` decides them."""
    return hasattr(model, "shard"), hasattr(model, "model") and hasattr(model.model, "pipeline")


def choose_parallelism(model: nn.Module, config: dict, size: int, requested: str) -> str:
    """ "tensor" or "pipeline" for this model over ``size`` ranks, or a
    DistributedConfigError saying why neither works."""
    tensor, pipeline = shard_support(model)
    cfg = config.get("text_config", config)
    reasons = []
    if not tensor:
        reasons.append(f"mlx-lm's {config.get('model_type')!r} model has no tensor-parallel shard()")
    else:
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = cfg.get(field)
            if isinstance(value, int) and value % size:
                tensor = False
                reasons.append(f"{field} = {value} is not divisible by {size} ranks (tensor parallelism)")
    if not pipeline:
        reasons.append(f"mlx-lm's {config.get('model_type')!r} model has no pipeline()")
    elif isinstance(cfg.get("num_hidden_layers"), int) and cfg["num_hidden_layers"] < size:
        pipeline = False
        reasons.append(f"{cfg['num_hidden_layers']} layers cannot be split over {size} ranks (pipeline)")
    if requested in ("auto", "tensor") and tensor:
        return "tensor"
    if requested in ("auto", "pipeline") and pipeline:
        return "pipeline"
    raise DistributedConfigError(
        f"this model cannot be sharded {'' if requested == 'auto' else requested + '-parallel '}over {size} ranks: "
        + "; ".join(reasons)
    )


def load_lazily(path: Path, trust_remote_code: bool) -> tuple[nn.Module, dict]:
    """The model with its weights mapped but not read (a GGUF file is read whole),
    so each rank reads only its shard when it is evaluated."""
    return loading.load_weights(path, trust_remote_code, lazy=True)


def cast_lazily(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """loading.apply_compute_dtype without evaluating: the cast is computed only
    for this rank's shard when the sharded weights are evaluated."""
    loading.apply_compute_dtype(model, dtype, evaluate=False)


def shard(model: nn.Module, group: mx.distributed.Group, parallelism: str) -> None:
    if parallelism == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
