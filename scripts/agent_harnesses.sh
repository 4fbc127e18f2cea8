#!/usr/bin/env bash
# One-shot runs of the coding-agent harnesses against a local server
# (docs/server.md, "Pointing the agents and clients at it"):
#   scripts/agent_harnesses.sh [MODEL] [codex|claude|both] [error|truncate-middle]
# Installs @openai/codex and @anthropic-ai/claude-code from npm into a temp
# folder, starts `python -m mlx_engine.server --model MODEL` on a free port,
# runs each harness once with a short prompt, and prints its exit status and
# the server's log lines. Harness prompts are long (Codex ~6-10k tokens, Claude
# Code 20k+): a model whose context is shorter answers "prompt is too long",
# unless the third argument starts the server with --context-overflow
# truncate-middle (the middle of the conversation is cut to fit instead).
set -u
MODEL="${1:-smollm2-135m-instruct}"
WHICH="${2:-both}"
OVERFLOW="${3:-error}"
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
  cat >"$CODEX_HOME/config.toml" <<TOML
model = "$MODEL"
model_provider = "mlx-engine"

[model_providers.mlx-engine]
name = "mlx-engine"
base_url = "$URL/v1"
wire_api = "responses"
# A long prompt's prefill on a CPU can pass Codex's 5-minute stream idle
# timeout (SSE keep-alive comments do not reset it): allow an hour.
stream_idle_timeout_ms = 3600000
TOML
  (cd "$WORK" && timeout 1800 "$WORK/node_modules/.bin/codex" exec --skip-git-repo-check "Say hello in one word." \
    >"$WORK/codex.out" 2>&1)
  echo "codex exit status: $?"
  tail -20 "$WORK/codex.out"
fi

if [ "$WHICH" != codex ]; then
  (cd "$WORK" && ANTHROPIC_BASE_URL="$URL" ANTHROPIC_API_KEY=none ANTHROPIC_MODEL="$MODEL" \
    ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" ANTHROPIC_SMALL_FAST_MODEL="$MODEL" DISABLE_TELEMETRY=1 \
    timeout 900 "$WORK/node_modules/.bin/claude" -p "Say hello in one word." >"$WORK/claude.out" 2>&1)
  echo "claude exit status: $?"
  tail -20 "$WORK/claude.out"
fi
echo "--- server log ($WORK/server.log)"
grep -v "GET /health" "$WORK/server.log" | tail -30
