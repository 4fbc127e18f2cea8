"""The machine, software and models a benchmark's numbers come from."""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import datetime as dt  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return platform.processor() or "unknown"
    return "unknown"


def _os_name() -> str:
    os_name = platform.platform()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = f"{line.split('=', 1)[1].strip(chr(34))} ({platform.system()} {platform.release()})"
    except OSError:
        pass
    return os_name


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    """The machine and software the numbers come from."""
    blas = me.blas_status()
    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "os": _os_name(),
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "unknown"),
        "mlx_lm": importlib.metadata.version("mlx-lm"),
        "mlx_engine": importlib.metadata.version("mlx-engine") if _has_dist("mlx-engine") else "source",
        "blas": {"backend": blas.backend, "path": blas.path, "reason": blas.reason},
        "git_commit": _git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_start": list(os.getloadavg()),
    }


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def model_info(path: Path, model, cfg: dict | None = None) -> dict[str, Any]:
    """A model's size and shape, for the report."""
    cfg = cfg if cfg is not None else json.loads((path / "config.json").read_text())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {
        "path": str(path),
        "parameters": params,
        "model_type": cfg.get("model_type"),
        "hidden_size": cfg.get("hidden_size"),
        "layers": cfg.get("num_hidden_layers"),
        "vocab_size": cfg.get("vocab_size"),
        "stored_dtype": cfg.get("torch_dtype") or path.suffix.lstrip("."),
        "compute_dtype": str(next(v for _, v in tree_flatten(model.parameters())).dtype).replace("mlx.core.", ""),
    }


def make_tiny_models(where: Path) -> tuple[Path, Path]:
    """Random-weight stand-ins (fixtures/tiny_models.py) for trying the harness."""
    from fixtures.tiny_models import make_model

    target, draft = where / "target", where / "draft"
    if not (target / "model.safetensors").exists():
        make_model(target, "llama", hidden=256, layers=4, scale=3.0)
    if not (draft / "model.safetensors").exists():
        make_model(draft, "llama", hidden=64, layers=1, tokenizer_from=target)
    return target, draft
