"""The trained demo model family shipped in models/ (skipped where it is absent,
e.g. in a checkout made before the models were added)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_same_or_near_tie, generate_ids

import mlx_engine as me

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = ROOT / "models" / "pystd-target", ROOT / "models" / "pystd-draft"
pytestmark = pytest.mark.skipif(
    not (TARGET / "model.safetensors").exists() or not (DRAFT / "model.safetensors").exists(),
    reason="bundled demo models not present",
)


def test_family_is_small_float16_and_documented():
    total = 0
    for d in (TARGET, DRAFT):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["torch_dtype"] == "float16"
        assert (d / "README.md").exists() and (d / "tokenizer.json").exists()
        total += sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert total <= 60 * 2**20


def test_target_and_draft_share_a_tokenizer_and_generate():
    kit = me.load_model(TARGET)
    assert me.check_draft_model(kit, DRAFT).compatible
    prompt = me.tokenize(kit, "def parse_args(argv):\n    ")
    plain, final = generate_ids(kit, prompt, max_tokens=24)
    assert len(plain) > 0 and final.stats.generated_tokens == len(plain)
    me.load_draft_model(kit, DRAFT)
    ids, spec = generate_ids(kit, prompt, max_tokens=24)
    assert spec.stats.decoding_mode == "draft_model"
    assert_same_or_near_tie(kit, prompt, plain, ids)


def test_demo_runs_on_the_bundled_model():
    out = subprocess.run([sys.executable, str(ROOT / "demo.py"), "--model", str(TARGET), "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "Generation stats:" in out.stdout
