"""Every ```python block of README.md and docs/*.md runs as written.

Blocks are found by scanning the files, so a new example is run (or must be
listed in ``NOT_RUN`` with its reason) the day it is added. Blocks that continue
an earlier one run with what that one defines (``CONTEXT``); the README's
client example runs against a server started here (its URL's port is the only
change); ``uvicorn.run`` in docs/server.md serves on a free port for one
request instead of forever.
"""

from __future__ import annotations

import mlx_engine as me

import json
import re
from pathlib import Path

import pytest
from helpers import requires_default_model

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

#: Blocks that are not run, by (file, index among its python blocks), and why.
NOT_RUN = {
    ("docs/api.md", 0): "a signature (load_model), not code",
    ("docs/api.md", 1): "a signature (create_generator), not code",
    ("docs/api.md", 2): "a signature (the result types), not code",
    ("docs/api.md", 3): "a signature (structured output arguments), not code",
    ("docs/api.md", 5): "a signature (the tool-call API), not code",
    ("docs/api.md", 7): "a signature (the prompt cache arguments), not code",
    ("docs/distributed.md", 0): "needs a 70B model and an mlx.launch job",
    ("docs/distributed.md", 1): "a signature (load_sharded_model), not code",
    ("docs/vision.md", 0): "needs a vision model and image files, none of which ship",
    ("docs/vision.md", 1): "a signature (load_model's image option), not code",
}
#: Blocks that continue the prose's running example: they use a loaded kit.
CONTEXT = {("docs/api.md", 4), ("docs/api.md", 6)}
#: The README's blocks that talk to a server started with the command above them.
SERVER_CLIENTS = {("README.md", 1), ("README.md", 2)}
#: docs/server.md's create_app example (it serves until stopped).
SERVER_APP = ("docs/server.md", 0)


def python_blocks() -> list[tuple[tuple[str, int], str]]:
    """(file, index) and source of every ```python block, in file order."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel = str(path.relative_to(ROOT))
        for i, m in enumerate(FENCE.finditer(path.read_text())):
            found.append(((rel, i), m.group(1)))
    return found


BLOCKS = python_blocks()
RUN = [(key, src) for key, src in BLOCKS if key not in NOT_RUN]


def test_every_block_is_run_or_skipped_for_a_reason():
    keys = {key for key, _ in BLOCKS}
    assert set(NOT_RUN) <= keys, f"NOT_RUN names blocks that no longer exist: {set(NOT_RUN) - keys}"
    assert CONTEXT | SERVER_CLIENTS | {SERVER_APP} <= keys


@pytest.fixture(scope="module")
def served_kit(smollm):
    """A server on the default model, as the README's command starts it."""
    from mlx_engine.server import create_app

    from helpers import serve

    with serve(create_app(smollm, model_id="smollm2-135m-instruct")) as url:
        yield url


def run_block(key, src, namespace: dict) -> dict:
    exec(compile(src, f"{key[0]}[{key[1]}]", "exec"), namespace)
    return namespace


@requires_default_model
@pytest.mark.parametrize("key,src", RUN, ids=[f"{k[0]}[{k[1]}]" for k, _ in RUN])
@pytest.mark.slow
def test_example_runs(key, src, smollm, request, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # examples name files relative to the repository
    namespace: dict = {"__name__": "__doc_example__"}
    if key in CONTEXT:
        namespace.update(me=me, json=json, kit=smollm)
    if key in SERVER_CLIENTS:
        url = request.getfixturevalue("served_kit")
        src = src.replace("http://127.0.0.1:8080", url)
    if key == SERVER_APP:
        import uvicorn

        monkeypatch.setattr(uvicorn, "run", serve_once)
    run_block(key, src, namespace)
    out = capsys.readouterr().out
    if key == ("README.md", 0):
        assert "Paris" in out and "tokens" in out
        assert namespace["answers"].keys() == {"Name a river.", "Name a mountain."}
        assert namespace["kit"].draft is None  # unloaded again
        assert namespace["lookup_text"] and namespace["auto_text"]
        assert "draft_model" in out
    if key in SERVER_CLIENTS:
        assert out.strip()
    if key == ("docs/api.md", 4):
        assert set(json.loads(namespace["text"])) == {"name", "age"}
    if key == ("docs/api.md", 6):
        assert namespace["calls"] and namespace["answer"].strip()


def serve_once(app, host: str, port: int, **kw) -> None:
    """``uvicorn.run`` for the docs/server.md example: serve on a free port,
    answer one chat request, stop."""
    import httpx
    from helpers import serve

    assert (host, port) == ("127.0.0.1", 8080)
    with serve(app) as url:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
