#!/usr/bin/env bash
# One-shot runs of the coding-agent harnesses against a local server
# (docs/server.md, "Pointing the agents and clients at it"):
#   scripts/agent_harnesses.sh [MODEL] [codex|claude|both] [error|truncate-middle]
# Installs @openai/codex and @anthropic-ai/claude-code from npm into a temp
# folder, starts `python -m mlx_engine.server --model MODEL` on a free port,
# runs each harness once with a short prompt, and prints its exit status and
# the server's log lines.
#
# The recipe for a small model (the default SmolLM2-135M has an 8k context):
# - Codex: `model_instructions_file` replaces its ~17 KB built-in instructions
#   with a short file, so its request is ~5.2k tokens (the tool definitions are
#   the rest); `model_context_window` tells it the real window.
# - Claude Code: `--tools ""` (print mode, no tools). Its default tool set is
#   ~19.5k tokens alone; Bash, Read, Edit and Write (~2.1k) fit in 8k, but the
#   135M model then never ends its answer (it writes to the context's end).
# With a longer-context model, drop both (FULL=1 keeps the harnesses' defaults).
# The third argument can start the server with --context-overflow
# truncate-middle (the middle of the conversation is cut to fit).
set -u
MODEL="${1:-smollm2-135m-instruct}"
WHICH="${2:-both}"
OVERFLOW="${3:-error}"
FULL="${FULL:-0}"   # CONTEXT=N: the model's context for Codex (default 8192)
PY="${PYTHON:-python}"
WORK="$(mktemp -d)"
PORT="$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null' EXIT

(cd "$WORK" && npm install --silent --no-audit --no-fund @openai/codex@0.171 @anthropic-ai/claude-code@2.1 >/dev/null 2>&1) \
  || { echo "npm install failed"; exit 1; }
$PY -m mlx_engine.server --model "$MODEL" --port "$PORT" --max-parallel 2 \
  --context-overflow "$OVERFLOW" >"$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do curl -sf "$URL/health" >/dev/null && break; sleep 1; done

if [ "$WHICH" != claude ]; then
  export CODEX_HOME="$WORK/codex-home"
  mkdir -p "$CODEX_HOME"
  INSTRUCTIONS=""
  if [ "$FULL" != 1 ]; then
    echo "You are a coding assistant in a terminal. Answer the user briefly, then stop." >"$CODEX_HOME/instructions.md"
    INSTRUCTIONS="model_instructions_file = \"$CODEX_HOME/instructions.md\""
  fi
  cat >"$CODEX_HOME/config.toml" <<TOML
model = "$MODEL"
model_provider = "mlx-engine"
$INSTRUCTIONS
model_context_window = ${CONTEXT:-8192}

[model_providers.mlx-engine]
name = "mlx-engine"
base_url = "$URL/v1"
wire_api = "responses"
# The server's keep-alive events (response.in_progress every 5 s) reset
# Codex's stream idle timer during a long prefill; IDLE_MS=N sets the timer.
${IDLE_MS:+stream_idle_timeout_ms = $IDLE_MS}
TOML
  (cd "$WORK" && timeout 1800 "$WORK/node_modules/.bin/codex" exec --skip-git-repo-check "Say hello in one word." \
    >"$WORK/codex.out" 2>&1)
  echo "codex exit status: $?"
  tail -20 "$WORK/codex.out"
fi

if [ "$WHICH" != codex ]; then
  (cd "$WORK" && ANTHROPIC_BASE_URL="$URL" ANTHROPIC_API_KEY=none ANTHROPIC_MODEL="$MODEL" \
    ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" ANTHROPIC_SMALL_FAST_MODEL="$MODEL" DISABLE_TELEMETRY=1 \
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 timeout 900 "$WORK/node_modules/.bin/claude" -p "Say hello in one word." \
    $([ "$FULL" = 1 ] || echo '--tools=') >"$WORK/claude.out" 2>&1)
  echo "claude exit status: $?"
  tail -20 "$WORK/claude.out"
fi
echo "--- server log ($WORK/server.log)"
grep -v "GET /health" "$WORK/server.log" | tail -30
