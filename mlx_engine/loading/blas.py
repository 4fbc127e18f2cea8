"""Make MLX's CPU backend use a system OpenBLAS when one is installed.

The ``mlx[cpu]`` wheel bundles a reference BLAS whose float32 matmul is 20-30x
slower than OpenBLAS. MLX resolves its BLAS symbols when ``mlx.core`` is first
loaded, so a library loaded earlier with ``RTLD_GLOBAL`` wins. This module must
therefore run before anything imports ``mlx.core``; ``mlx_engine/__init__.py``
imports it first.

Set ``MLX_ENGINE_DISABLE_OPENBLAS=1`` to keep the bundled BLAS, or
``MLX_ENGINE_OPENBLAS=/path/libopenblas.so`` to pick a library.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import sys
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DISABLE_ENV = "MLX_ENGINE_DISABLE_OPENBLAS"
PATH_ENV = "MLX_ENGINE_OPENBLAS"

# Debian/Ubuntu first (pthread build, then the alternatives symlink), then
# Fedora/Arch style locations.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU backend uses in this process, and why."""

    backend: str  # "openblas", "bundled" or "accelerate"
    path: str | None
    reason: str


_status: BlasStatus | None = None


def _find_library() -> str | None:
    explicit = os.environ.get(PATH_ENV)
    if explicit:
        return explicit if os.path.exists(explicit) else None
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def setup_blas() -> BlasStatus:
    """Load OpenBLAS globally if possible; idempotent. Returns what happened."""
    global _status
    if _status is not None:
        return _status
    if platform.system() == "Darwin":
        _status = BlasStatus("accelerate", None, "macOS: MLX uses Accelerate/Metal")
    elif os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        _status = BlasStatus("bundled", None, f"disabled by {DISABLE_ENV}")
    elif "mlx.core" in sys.modules:
        _status = BlasStatus("bundled", None, "mlx.core was imported before mlx_engine; too late to swap BLAS")
    else:
        path = _find_library()
        _share_cores_between_local_ranks()
        if path is None:
            _status = BlasStatus("bundled", None, "no system OpenBLAS found (apt install libopenblas0-pthread)")
        else:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                _status = BlasStatus("openblas", path, "loaded before mlx.core")
            except OSError as exc:
                _status = BlasStatus("bundled", None, f"failed to load {path}: {exc}")
    level = logging.INFO if _status.backend != "bundled" else logging.WARNING
    if platform.system() != "Darwin":
        logger.log(level, "BLAS for MLX CPU: %s (%s)", _status.backend, _status.path or _status.reason)
    return _status


def _share_cores_between_local_ranks() -> None:
    """Under mlx.launch (MLX_RANK set) with several ranks on this machine, give
    each rank's OpenBLAS an equal share of the cores unless OPENBLAS_NUM_THREADS is
    set: OpenBLAS threads spin while they wait, and two ranks each running a thread
    per core made 2-rank passes 3-4x slower on a 2-core machine (docs/distributed.md)."""
    if "MLX_RANK" not in os.environ or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    try:
        with open(os.environ.get("MLX_HOSTFILE", ""), encoding="utf-8") as f:
            ips = [str(entry[0]).rpartition(":")[0] for entry in json.load(f)]
        local = ips.count(ips[int(os.environ["MLX_RANK"])])
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return
    if local > 1:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))


def blas_status() -> BlasStatus:
    """The BLAS decision made when ``mlx_engine`` was imported."""
    return setup_blas()
