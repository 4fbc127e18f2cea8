"""Measured forward costs kept on disk, so a process does not measure again
what an earlier one measured for the same model on the same machine.

A record is one small JSON file named by the hash of its key: what the costs
depend on (the model's files, dtype and cache options, the MLX and mlx-lm
versions, the machine and device). The key is stored in the file too and
compared on read, so a hash collision or a file copied from elsewhere is a
miss. Files are written to a temporary name and renamed, so a concurrent
reader sees a whole record or none; two processes measuring at once both write
and the last rename wins. Anything unreadable or malformed is a miss (logged,
then overwritten by the next measurement): a name that is not a regular file (a
FIFO, a device, a folder) is never read from, a file over ``MAX_RECORD_BYTES``
is not read whole, and JSON nested too deep to parse is caught. ``MLX_ENGINE_COST_DIR`` picks the
directory (default ``$XDG_CACHE_HOME/mlx_engine/costs``, else
``~/.cache/mlx_engine/costs``); set to an empty string it turns the store off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import stat
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024  # a record is a few hundred bytes; anything larger is not one


def store_dir() -> Path | None:
    """The directory records live in, or None when the store is off."""
    configured = os.environ.get("MLX_ENGINE_COST_DIR")
    if configured is not None:
        return Path(configured).expanduser() if configured.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "mlx_engine" / "costs"


@lru_cache(maxsize=1)
def machine_identity() -> dict:
    """What makes timings of the same model differ between machines and installs."""
    import mlx_lm

    device = mx.default_device()
    ident = {
        "host": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "system": platform.system(),
        "device": str(device),
        "mlx": mx.__version__,
        "mlx_lm": getattr(mlx_lm, "__version__", "?"),
    }
    if device.type == mx.gpu and hasattr(mx, "device_info"):
        try:
            ident["gpu"] = str(mx.device_info().get("device_name", ""))
        except Exception:  # pragma: no cover - device_info differs by backend and version
            pass
    return ident


FROM_ENVIRONMENT = "from the environment"  # ``root`` default: store_dir() now


def _path(key: dict, root: Path | None | str = FROM_ENVIRONMENT) -> tuple[Path, str] | None:
    root = store_dir() if root == FROM_ENVIRONMENT else root
    if root is None:
        return None
    text = json.dumps({"v": FORMAT_VERSION, **key}, sort_keys=True)
    return root / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".json"), text


def load(key: dict, root: Path | None | str = FROM_ENVIRONMENT) -> dict | None:
    """The record stored under ``key`` (its ``value``) in ``root``, or None."""
    where = _path(key, root)
    if where is None:
        return None
    path, text = where
    try:
        record = json.loads(read_regular(path, MAX_RECORD_BYTES).decode("utf-8"))
        if not isinstance(record, dict) or record.get("key") != text or not isinstance(record.get("value"), dict):
            raise ValueError("not a record for this key")
        return record["value"]
    except FileNotFoundError:
        return None
    # RecursionError: JSON nested deeper than the parser's stack (a hostile file).
    except (OSError, ValueError, RecursionError) as exc:
        logger.info("measured costs: ignoring %s (%s); measuring again", path, exc)
        return None


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is a regular file (symlinks followed) of at
    most ``max_bytes``, else ValueError. Opened without blocking and checked on
    the open file, so a FIFO or device under the name is never read from (a
    FIFO would block the engine thread for good, ``/dev/zero`` never ends); at
    most ``max_bytes`` + 1 bytes are read, so a file growing meanwhile is
    refused too (as the prompt cache's disk tier opens its files)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file (a FIFO, device or folder)")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"more than the {max_bytes} bytes a record can have")
    return data


def save(key: dict, value: dict, root: Path | None | str = FROM_ENVIRONMENT) -> None:
    """Store ``value`` under ``key`` in ``root`` (atomically; failures are logged, never raised)."""
    where = _path(key, root)
    if where is None:
        return
    path, text = where
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": text, "value": value}, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        logger.warning("measured costs: cannot write %s (%s); they will be measured again next time", path, exc)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def positive_floats(value, length: int | None = None) -> list[float] | None:
    """``value`` as a list of finite positive floats (of ``length``), or None."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in value):
        return None
    return [float(x) for x in value]


def stored_ratio(key: dict | None, measure: Callable[[], float]) -> float:
    """The ratio stored under ``key`` (a draft step in main-model steps), else
    ``measure()``, stored there; with no key, measured and not stored."""
    record = (load(key) if key is not None else None) or {}
    stored = positive_floats([record.get("ratio")], 1)
    if stored is not None:
        return stored[0]
    ratio = measure()
    if key is not None:
        save(key, {"ratio": ratio})
    return ratio
