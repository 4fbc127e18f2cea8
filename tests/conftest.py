"""Fixtures shared by the suite; plain helper functions live in helpers.py."""

import os

# The README's test command runs the suite in two pytest-xdist workers, one per core:
# each worker's OpenBLAS then takes one thread, not both cores (two threads per worker
# contend for the cores with the other worker's; the fast subset took 308 s so and
# 241 s with one thread each on the 2-core Zen 3 machine). Read when OpenBLAS loads,
# so set before the import below; a value the caller set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import mlx_engine  # noqa: E402, F401  (first of the engine: loads OpenBLAS before mlx.core)

import tempfile
from pathlib import Path

import pytest

from fixtures.gguf_families import make_family  # noqa: E402
from fixtures.tiny_models import make_model, make_tokenizer  # noqa: E402

# Measured forward costs (pricing/cost_store.py) go to a directory of this run,
# never the user's cache (nor a folder the user's shell named): every run measures
# as a fresh machine would, and tests never write into the user's home. Set
# unconditionally, before any test (or subprocess it starts) reads it; subprocesses
# inherit it (tests that clean their environment keep MLX_ENGINE_* variables).
COST_DIR = tempfile.mkdtemp(prefix="mlx-engine-costs-")
os.environ["MLX_ENGINE_COST_DIR"] = COST_DIR


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_path(models_dir) -> Path:
    return make_model(models_dir / "llama", "llama", hidden=64, layers=2, scale=3.0, seed=1)


@pytest.fixture(scope="session")
def qwen_path(models_dir, llama_path) -> Path:
    return make_model(models_dir / "qwen2", "qwen2", hidden=64, layers=2, scale=3.0, seed=2, tokenizer_from=llama_path)


@pytest.fixture(scope="session")
def draft_path(models_dir, llama_path) -> Path:
    """A smaller model sharing the llama fixture's tokenizer, with a padded embedding."""
    return make_model(
        models_dir / "draft", "llama", hidden=32, layers=1, scale=3.0, seed=3, vocab_pad=16, tokenizer_from=llama_path
    )


@pytest.fixture(scope="session")
def foreign_tokenizer_path(models_dir) -> Path:
    """A model whose tokenizer was trained on different text (ids differ)."""
    out = models_dir / "foreign"
    out.mkdir()
    make_tokenizer(out, vocab_size=380, extra_text="zzzz yyyy xxxx qqqq " * 50)
    return make_model(out, "llama", hidden=32, layers=1, seed=4, tokenizer_from=out)


@pytest.fixture
def cheap_draft(monkeypatch):
    """Draft models priced at a tenth of their target's step. The tiny random
    fixtures cost about what their targets do, which no real draft does, so
    the adaptive draft length would never draft with them; with this it
    drafts from the prior in its first rounds (their drafts are rejected, and
    scoring then keeps it undrafted)."""
    from mlx_engine.draft.model import DraftModel

    monkeypatch.setattr(DraftModel, "chained_step_ratio", lambda self, *a, **k: 0.1)


@pytest.fixture
def kit(llama_path):
    """A fresh kit of its own, for a test that changes it (caches, drafts, patches)."""
    k = mlx_engine.load_model(llama_path)
    yield k
    mlx_engine.unload(k)


@pytest.fixture(scope="module")
def shared_kit(llama_path):
    """One kit for a module's tests that only need one: calls refused before any
    work, short generations whose cache reuse their assertions do not read."""
    k = mlx_engine.load_model(llama_path)
    yield k
    mlx_engine.unload(k)


@pytest.fixture(scope="session")
def smollm():
    """The real default model, loaded once for the whole run. It measures its
    forward costs at its first speculative request, not between requests: a
    kit that lives all the run would otherwise run measurement passes whenever
    the process idles for a second, inside other tests, whose process-wide MLX
    memory readings (the soak, the model host's load/unload cycles) then saw
    its scratch arrays come and go (+162,866 B once, -1,448 B once)."""
    kit = mlx_engine.load_model(mlx_engine.DEFAULT_MODEL)
    kit.background_cost_measurement = False
    yield kit
    mlx_engine.unload(kit)


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """``family_files(family, qtype="F32")``: a small GGUF of that family (made once a
    module by fixtures/gguf_families.make_family): its path, reference and model file."""
    cache = {}

    def get(family, qtype="F32"):
        if (family, qtype) not in cache:
            cache[family, qtype] = make_family(family, tmp_path_factory.mktemp(f"{family}-{qtype}"), qtype)
        return cache[family, qtype]

    return get
