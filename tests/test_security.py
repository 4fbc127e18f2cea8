"""Security stance (docs/reliability.md): no code from a model folder runs without
trust_remote_code=True, for the model and the tokenizer alike, and the engine
never asks anything on stdin."""

import mlx_engine as me

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CUSTOM_TOKENIZER = """
import os, pathlib
pathlib.Path(os.environ["MARKER"]).write_text("the model folder's code ran")
from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""

LOAD = r"""
import sys, mlx_engine as me
try:
    kit = me.load_model(sys.argv[1], trust_remote_code=sys.argv[2] == "1")
    print("loaded", type(kit.tokenizer._tokenizer).__name__)
except me.ModelLoadError as exc:
    print("ModelLoadError", exc)
"""


@pytest.fixture
def remote_code_model(tmp_path, llama_path):
    """A model whose tokenizer_config.json maps AutoTokenizer to Python in the folder."""
    d = shutil.copytree(llama_path, tmp_path / "remote")
    (d / "tokenization_custom.py").write_text(CUSTOM_TOKENIZER)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    cfg["tokenizer_class"] = "CustomTokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def load_with_stdin(model: Path, trust: bool, tmp_path: Path) -> tuple[str, bool]:
    """Load in a subprocess whose stdin answers 'y' to any prompt."""
    marker = tmp_path / "marker"
    marker.unlink(missing_ok=True)
    env = dict(os.environ, MARKER=str(marker), HF_MODULES_CACHE=str(tmp_path / "modules"))
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(model), "1" if trust else "0"],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[y/N]" not in out.stdout + out.stderr, "the engine let a library prompt on stdin"
    return out.stdout, marker.exists()


@pytest.mark.slow
def test_tokenizer_code_needs_trust_remote_code(remote_code_model, tmp_path):
    stdout, ran = load_with_stdin(remote_code_model, False, tmp_path)
    assert not ran, "code from the model folder ran without trust_remote_code"
    assert "ModelLoadError" in stdout and "custom code" in stdout
    stdout, ran = load_with_stdin(remote_code_model, True, tmp_path)
    assert ran and "loaded CustomTokenizer" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "directory", "dangling"])
def test_model_files_that_are_not_regular_files_are_refused(tmp_path, llama_path, target):
    """A tokenizer.json linked to /dev/zero or a FIFO would be read forever (memory
    grows, the load never returns); run in a subprocess so a regression fails on
    its timeout instead of hanging the suite."""
    d = shutil.copytree(llama_path, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
        target = tmp_path / "fifo"
    elif target == "directory":
        (d / "tokenizer.json").mkdir()
    elif target == "dangling":
        target = tmp_path / "nothing-here"
    if target != "directory":
        (d / "tokenizer.json").symlink_to(target)
    code = "import sys, mlx_engine as me\ntry:\n    me.load_model(sys.argv[1])\nexcept me.ModelLoadError as exc:\n    print('ModelLoadError', exc)"
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ModelLoadError"), out.stdout


def test_symlinked_weights_load(tmp_path, llama_path):
    """Hugging Face cache folders link every file to a blob: links to regular files load."""
    import mlx_engine as me

    d = tmp_path / "linked"
    d.mkdir()
    for f in llama_path.iterdir():
        (d / f.name).symlink_to(f)
    assert me.load_model(d).model is not None


# -- chat templates: code from the model files, bounded in time and size ----------
HOSTILE_TEMPLATES = {
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x",
    "loops over a list": "{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}{{ '' }}{% endfor %}{% endfor %}",
    "string repetition": "{{ 'x' * 3000000000 }}",
    "list repetition": "{{ ([1] * 3000000000)|length }}",
    "center filter": "{{ 'x'|center(3000000000) }}",
    "str method": "{{ 'x'.rjust(3000000000) }}",
    "format width": "{{ '{:>999999999}'.format('a') }}",
    "percent width": "{{ '%999999999s' % 'a' }}",
    "huge power": "{{ 9 ** 999999999 }}",
    "long output": "{% for a in range(100000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}",
}


def _with_template(src, dst, template: str):
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dst


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_chat_templates_fail_with_a_named_limit(tmp_path, llama_path, name, monkeypatch):
    from mlx_engine.loading import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)  # keeps the looping ones short
    kit = me.load_model(_with_template(llama_path, tmp_path / "m", HOSTILE_TEMPLATES[name]), vocab_only=True)
    with pytest.raises(me.ChatTemplateLimitError, match="messages: the chat template"):
        me.apply_chat_template(kit, [{"role": "user", "content": "hi"}])
    assert me.tokenize(kit, "still usable")


def test_bounded_render_gives_transformers_output(llama_path):
    """The bounded sandbox only gates: the prompt is transformers' rendering."""
    kit = me.load_model(llama_path, vocab_only=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " * 2000}]
    expected = list(kit.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert me.apply_chat_template(kit, messages) == expected
