"""The requests of ``bench.agent_sessions``' replayed sessions, shaped like the
coding-agent harnesses' (docs/server.md, "Coding agents"): a turn's body and the
history the next turn re-sends, for Claude Code (``/v1/messages``) and Codex
(``/v1/responses``)."""

from __future__ import annotations

MODEL = "agent"
RULES = [
    "Read a file before editing it and keep edits minimal.",
    "Prefer the dedicated tools over shell commands for reading and searching.",
    "Never commit unless the user asks; explain what you changed in one line.",
    "Run the tests that cover a change before saying it is done.",
]
BASE_LINES = 48  # about 1k tokens; --base-lines 240 makes the stable prefix as long as the harnesses' (4-5k tokens)


def base_prompt(lines: int) -> str:
    """The harness's long, unchanging instructions (``lines`` rules)."""
    return "\n".join(f"{i}. {RULES[i % len(RULES)]} (section {i // len(RULES)})" for i in range(lines))


SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}}, "required": ["path"]}
TOOL_NAMES = ("read_file", "edit_file", "run_tests", "grep")


def source_file(turn: int) -> str:
    """A module the agent keeps editing: one line changes per turn."""
    lines = [f"def step_{i}(x):\n    return x * {i} + {turn if i == turn % 12 else 0}\n" for i in range(12)]
    return "".join(lines)


# -- the sessions ----------------------------------------------------------------------------------
def claude_turn(turn: int, history: list[dict], cold: bool, max_tokens: int, base: str, decoding: str) -> dict:
    """Turn ``turn``'s body (``max_tokens`` kept short here; Claude Code sends
    32000, which the server caps by the context): the history, a tool result with the file and a
    new instruction, and this turn's reminder after it."""
    header = f"x-anthropic-billing-header: cc_version=2.1.3.{turn:03d}; cc_entrypoint=cli; cch={turn * 7919:05x};"
    user = {
        "role": "user",
        "content": [{"type": "text", "text": f"Change step_{turn % 12} so that it adds {turn}. Then run the tests."}],
    }
    reminder = {
        "role": "system",
        "content": f"<system-reminder>todo: {turn} of {turn + 3} tasks done</system-reminder>",
    }
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "system": [
            {"type": "text", "text": header},
            {"type": "text", "text": "You are a coding agent.\n" + base},
        ],
        "tools": [{"name": n, "description": f"{n} a path", "input_schema": SCHEMA} for n in TOOL_NAMES],
        "messages": [*history, user, reminder],
        "mlx_engine": {"decoding": decoding},
    }


def claude_history(body: dict, answer: list[dict], turn: int) -> list[dict]:
    """The history the next turn re-sends: this turn's messages (its reminder
    gone), the answer, and a tool result per call (else the file as text)."""
    history = body["messages"][:-1] + [{"role": "assistant", "content": answer or [{"type": "text", "text": ""}]}]
    uses = [b for b in answer if b["type"] == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": u["id"], "content": source_file(turn)} for u in uses]
    return history + [{"role": "user", "content": results or [{"type": "text", "text": source_file(turn)}]}]


def codex_turn(turn: int, history: list[dict], cold: bool, max_tokens: int, base: str, decoding: str) -> dict:
    nonce = f"session nonce {turn}\n" if cold else ""
    user = {
        "role": "user",
        "content": [{"type": "input_text", "text": f"Turn {turn}: make step_{turn % 12} add {turn}."}],
    }
    return {
        "model": MODEL,
        "stream": True,
        "store": False,
        "temperature": 0,
        "max_output_tokens": max_tokens,
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": nonce + base}]},
            *history,
            user,
        ],
        "tools": [
            {"type": "function", "name": "shell", "description": "run a command", "parameters": SCHEMA},
            {
                "type": "namespace",
                "name": "files",
                "description": "file tools",
                "tools": [{"type": "function", "name": n, "parameters": SCHEMA} for n in TOOL_NAMES[:2]],
            },
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "bench",
        "mlx_engine": {"decoding": decoding},
    }


def codex_history(body: dict, output: list[dict], turn: int) -> list[dict]:
    history = body["input"][1:] + output
    calls = [o for o in output if o["type"] == "function_call"]
    outs = [{"type": "function_call_output", "call_id": c["call_id"], "output": source_file(turn)} for c in calls]
    return history + (outs or [{"role": "user", "content": [{"type": "input_text", "text": source_file(turn)}]}])
