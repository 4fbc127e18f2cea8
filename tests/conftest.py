import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx_engine  # noqa: E402,F401  (loads OpenBLAS before mlx.core)
from tiny_models import make_model, make_tokenizer  # noqa: E402


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
    return make_model(models_dir / "draft", "llama", hidden=32, layers=1, scale=3.0, seed=3, vocab_pad=16, tokenizer_from=llama_path)


@pytest.fixture(scope="session")
def foreign_tokenizer_path(models_dir) -> Path:
    """A model whose tokenizer was trained on different text (ids differ)."""
    out = models_dir / "foreign"
    out.mkdir()
    make_tokenizer(out, vocab_size=380, extra_text="zzzz yyyy xxxx qqqq " * 50)
    return make_model(out, "llama", hidden=32, layers=1, seed=4, tokenizer_from=out)


@pytest.fixture
def kit(llama_path):
    k = mlx_engine.load_model(llama_path)
    yield k
    mlx_engine.unload(k)


def generate_ids(kit, prompt, **kw):
    """All token ids of one generation and its final result."""
    ids, last = [], None
    for r in mlx_engine.create_generator(kit, prompt, **kw):
        ids.extend(t.id for t in r.tokens)
        last = r
    return ids, last
