import subprocess
import sys
from pathlib import Path

import pytest
from helpers import requires_default_model

import demo

pytestmark = pytest.mark.slow  # subprocesses: every test starts Python (and MLX) anew


ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_plain_decoding():
    args = demo.parse_args([])
    assert args.auto_speculative is False
    assert args.prompt_lookup_num_tokens is None
    assert args.draft_model is None and args.num_draft_tokens is None


def test_speculative_flags_parse(draft_path):
    d = str(draft_path)  # checked to exist before any model loads
    args = demo.parse_args(["--auto-speculative", "--prompt-lookup-num-tokens", "6", "--draft-model", d])
    assert args.auto_speculative and args.prompt_lookup_num_tokens == 6 and args.draft_model == d
    assert demo.parse_args(["--draft-model", d, "--num-draft-tokens", "3"]).num_draft_tokens == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt-lookup-num-tokens", "4", "--draft-model", "d"],
        ["--num-draft-tokens", "3"],
        ["--max-tokens", "0"],
        ["--regex", "a", "--json-schema", "s.json"],
        ["--parallel", "0"],
        ["--parallel", "2", "--chat"],
    ],
)
def test_conflicting_flags_are_rejected(argv):
    with pytest.raises(SystemExit) as err:
        demo.parse_args(argv)
    assert err.value.code == 2


def test_demo_runs_end_to_end(llama_path, draft_path):
    cmd = [
        sys.executable,
        str(ROOT / "demo.py"),
        "--model",
        str(llama_path),
        "--prompt",
        "hello",
        "--max-tokens",
        "8",
        "--draft-model",
        str(draft_path),
        "--num-draft-tokens",
        "2",
        "--print-prompt-progress",
        "--system",
        "be brief",
        "--top-logprobs",
        "2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "Generation stats:" in out.stdout
    assert "Stop reason: token_limit" in out.stdout
    assert "Acceptance rate" in out.stdout


def test_demo_explains_missing_model(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "demo.py"), "--model", str(tmp_path / "nope"), "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode != 0
    assert "does not exist" in out.stderr


def run_demo(args, stdin=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "demo.py"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "args, stdin, match",
    [
        (["--stop-strings", ""], None, "--stop-strings"),
        (["--temp", "-1"], None, "temp must be >= 0"),
        (["--temp", "nan"], None, "temp must be a finite number"),
        (["--prompt", "-"], "", "standard input was empty"),
        (["--images", "no-such.png"], None, "--images: 'no-such.png' is not a file"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(llama_path, args, stdin, match):
    out = run_demo(["--model", str(llama_path), "--max-tokens", "2", *args], stdin)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]  # argparse's own errors come after a usage block
    assert last.startswith("demo.py: error: ") and match in last and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        (["--json-schema", "no-such.json"], "--json-schema: 'no-such.json' is not a file"),
        (["--grammar", "no-such.lark"], "--grammar: 'no-such.lark' is not a file"),
        (["--regex", "("], "unclosed group"),
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--stop-strings", ""], "--stop-strings"),
        (["--tools", "no-such.json"], "--tools: 'no-such.json' is not a file"),
        (["--draft-model", "no/such/draft"], "--draft-model: 'no/such/draft' was not found"),
    ],
)
def test_flag_mistakes_are_found_before_the_model_loads(args, match):
    """Checked first: the model named here does not exist, yet the flag's mistake is what is reported."""
    out = run_demo(["--model", "no/such/model", *args])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo.py: error: ") and match in lines[0], out.stderr


def test_bad_schema_file_is_one_line(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text("{not json")
    out = run_demo(["--model", "no/such/model", "--json-schema", str(schema)])
    assert out.returncode == 2 and "is not JSON" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_missing_draft_is_not_found_rather_than_incompatible(llama_path, tmp_path):
    """Past the demo's own check (a folder that exists but holds no model), the SDK says what is wrong."""
    (tmp_path / "draft").mkdir()
    out = run_demo(["--model", str(llama_path), "--draft-model", str(tmp_path / "draft"), "--max-tokens", "2"])
    assert out.returncode == 2 and "not compatible" not in out.stderr and "no config.json" in out.stderr, out.stderr


def test_help_explains_every_option():
    for action in demo.build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
            if action.default not in (None, False, []):
                assert "default" in action.help, action.dest


def test_missing_model_names_the_folders_searched():
    out = run_demo(["--model", "no-such-model-name", "--max-tokens", "2"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "does not exist" in out.stderr and str(demo.LMSTUDIO_DIRS[0]) in out.stderr


def test_stats_separate_the_cost_set_up(llama_path, draft_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))  # nothing stored: a few steps are timed
    out = run_demo(
        ["--model", str(llama_path), "--draft-model", str(draft_path), "--max-tokens", "4", "--prompt", "hi"]
    )
    assert out.returncode == 0, out.stderr
    assert "Cost set-up:" in out.stdout


def test_decoding_line_names_the_first_decision_after_a_switch():
    import mlx_engine as me

    s = me.GenerationStats(
        decoding_mode="auto:prompt_lookup",
        mode_reason="prompt 40 tokens: prompt too short or sparse for lookup",
        mode_switches=["plain -> prompt_lookup: lookup would have had 90% accepted"],
    )
    assert demo.decoding_line(s) == (
        "Decoding: auto:prompt_lookup; started as plain - prompt 40 tokens: prompt too short or sparse for lookup"
    )
    assert demo.decoding_line(me.GenerationStats(decoding_mode="plain")) == "Decoding: plain"


@requires_default_model
def test_demo_parallel_answers_every_question_with_the_default_model():
    out = run_demo(["--parallel", "3", "--max-tokens", "24"])
    assert out.returncode == 0, out.stderr
    assert [f"[{i}] > " in out.stdout for i in (1, 2, 3)] == [True] * 3
    assert "Paris" in out.stdout.split("[2] > ")[0]
    assert "3 requests," in out.stderr and "tok/s aggregate" in out.stderr


@requires_default_model
def test_demo_answers_with_the_default_model():
    out = subprocess.run([sys.executable, str(ROOT / "demo.py")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    answer = out.stdout.split("Generation stats:")[0]
    assert "capital of France" in answer and "Paris" in answer.split("?", 1)[1]
    assert "Stop reason: eos_token" in out.stdout
    assert "Peak memory:" in out.stdout


@requires_default_model
def test_demo_chat_reuses_the_cache_each_turn():
    turns = "What is the capital of France?\nAnd of Italy?\n\n"
    out = subprocess.run(
        [sys.executable, str(ROOT / "demo.py"), "--chat", "--max-tokens", "24"],
        input=turns,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    cached = [int(line.split("(")[1].split()[0]) for line in out.stdout.splitlines() if "reused from cache" in line]
    assert len(cached) == 2
    assert cached[0] == 0 and cached[1] > 20
    assert "Paris" in out.stdout and "Rome" in out.stdout


def test_chat_refuses_prompt():
    with pytest.raises(SystemExit) as err:
        demo.parse_args(["--chat", "--prompt", "hi"])
    assert err.value.code == 2


def test_demo_json_schema(tmp_path, llama_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "demo.py"),
            "--model",
            str(llama_path),
            "--prompt",
            "hi",
            "--json-schema",
            str(schema),
            "--max-tokens",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert '{"ok": ' in out.stdout


@requires_default_model
def test_demo_tools_calls_the_calculator_and_answers_from_its_result():
    out = run_demo(["--tools", "examples/tools.json", "--max-tokens", "48"])
    assert out.returncode == 0, out.stderr
    assert '[tool call] calculator({"expression": "23 * 19"}) -> {"result": 437}' in out.stdout
    assert "437" in out.stdout.split("[tool call]")[1].split("Generation stats:")[0].split("\n", 1)[1]
    assert "<tool_call>" not in out.stdout


def test_demo_tools_arithmetic_runs_nothing_but_arithmetic():
    assert demo.arithmetic("(2 + 3) * 4 ^ 2") == 80
    with pytest.raises(ValueError, match="not arithmetic"):
        demo.arithmetic("__import__('os').system('true')")
    call = demo.me.ToolCall(0, "call_1", "nope", {})
    assert "no implementation" in demo.run_tool(call)["error"]


def test_demo_tools_refuses_chat():
    with pytest.raises(SystemExit) as err:
        demo.parse_args(["--tools", "examples/tools.json", "--chat"])
    assert err.value.code == 2
