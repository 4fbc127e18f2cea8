import mlx_engine as me
from mlx_engine.loading import blas as _blas

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import generate_ids

ROOT = Path(__file__).resolve().parents[1]


def _status_in_fresh_process(env_extra: dict) -> str:
    code = "import mlx_engine; s = mlx_engine.blas_status(); print(s.backend, s.path)"
    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(not any(os.path.exists(p) for p in _blas.CANDIDATES), reason="no system OpenBLAS installed")
def test_openblas_fast_path_taken_when_present():
    out = _status_in_fresh_process({})
    assert out.startswith("openblas /")
    # And it is really mapped into the process before mlx runs.
    code = "import mlx_engine, mlx.core as mx; print(any('openblas' in l for l in open('/proc/self/maps')))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "True"


@pytest.mark.slow
def test_openblas_can_be_disabled():
    assert _status_in_fresh_process({_blas.DISABLE_ENV: "1"}).startswith("bundled")


def test_no_network_is_touched(llama_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    kit = me.load_model(llama_path)
    ids, final = generate_ids(kit, me.tokenize(kit, "hi"), max_tokens=3)
    assert len(ids) == 3
    with pytest.raises(me.ModelLoadError):
        me.load_model("mlx-community/Qwen2.5-0.5B-Instruct")
