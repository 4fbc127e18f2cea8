import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import demo  # noqa: E402


def test_defaults_are_plain_decoding():
    args = demo.parse_args([])
    assert args.auto_speculative is False
    assert args.prompt_lookup_num_tokens is None
    assert args.draft_model is None and args.num_draft_tokens is None


def test_speculative_flags_parse():
    args = demo.parse_args(["--auto-speculative", "--prompt-lookup-num-tokens", "6", "--draft-model", "d"])
    assert args.auto_speculative and args.prompt_lookup_num_tokens == 6 and args.draft_model == "d"
    assert demo.parse_args(["--draft-model", "d", "--num-draft-tokens", "3"]).num_draft_tokens == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt-lookup-num-tokens", "4", "--draft-model", "d"],
        ["--num-draft-tokens", "3"],
        ["--max-tokens", "0"],
    ],
)
def test_conflicting_flags_are_rejected(argv):
    with pytest.raises(SystemExit) as err:
        demo.parse_args(argv)
    assert err.value.code == 2


def test_demo_runs_end_to_end(llama_path, draft_path):
    cmd = [sys.executable, str(ROOT / "demo.py"), "--model", str(llama_path), "--prompt", "hello", "--max-tokens", "8",
           "--draft-model", str(draft_path), "--num-draft-tokens", "2", "--print-prompt-progress", "--system", "be brief", "--top-logprobs", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "Generation stats:" in out.stdout
    assert "Stop reason: token_limit" in out.stdout
    assert "Acceptance rate" in out.stdout


def test_demo_explains_missing_model(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "demo.py"), "--model", str(tmp_path / "nope"), "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert "does not exist" in out.stderr
