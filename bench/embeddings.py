"""Embeddings benchmark: ``python -m bench.embeddings --reference-python /tmp/refenv/bin/python [--rounds 5]``.

Embeds 1,000 sentences (English prose: sentences of the standard library's
docstrings, 20 to 400 characters, from the modules listed in ``_MODULES``) with all-MiniLM-L6-v2, by ``mlx_engine.embed`` and by
sentence-transformers (PyTorch, CPU) in the same run, rounds alternating so
both see the same machine load. The reference side runs in a separate Python
(``--reference-python``), a venv with ``torch`` and ``sentence-transformers``,
neither of which mlx-engine depends on::

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch sentence-transformers

Both use batch size 32 (sentence-transformers' default; it also sorts by
length) and every CPU core; with ``OPENBLAS_NUM_THREADS=N`` in the environment
both use N threads (the engine's OpenBLAS reads it at start; the reference
side calls ``torch.set_num_threads(N)``), which on a machine busy with other
work compares the two more fairly than oversubscribed cores. Reported: sentences per second (median of the
rounds, each embedding all 1,000), the cosine between the two sides' vectors
(min and mean over the 1,000) and load times. Writes
``<out>/embeddings.md`` and ``<out>/embeddings.json``.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core
from mlx_engine.loading import catalog

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .machine import machine_info

N_SENTENCES = 1000
MODEL = "all-minilm-l6-v2"

# The reference side, run by --reference-python: load, warm up, then one timed
# encode of all sentences per round (the parent starts one process per round,
# so rounds alternate with the engine's).
_REFERENCE = """
import json, os, sys, time
import numpy as np, torch
from sentence_transformers import SentenceTransformer
model_dir, sentences_file, out = sys.argv[1:4]
if os.environ.get("OPENBLAS_NUM_THREADS"):  # the engine's BLAS threads: the same number for torch
    torch.set_num_threads(int(os.environ["OPENBLAS_NUM_THREADS"]))
sentences = json.load(open(sentences_file))
t = time.perf_counter()
model = SentenceTransformer(model_dir, device="cpu")
load_s = time.perf_counter() - t
model.encode(sentences[:64], batch_size=32)
t = time.perf_counter()
vectors = model.encode(sentences, batch_size=32, convert_to_numpy=True)
seconds = time.perf_counter() - t
np.save(out, vectors.astype(np.float32))
import sentence_transformers
print(json.dumps({"seconds": seconds, "load_s": load_s, "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__}))
"""


_MODULES = (
    "argparse asyncio bisect calendar codecs collections contextlib copy csv dataclasses datetime decimal email "
    "enum fractions functools heapq http.client inspect itertools json logging math operator os pathlib pickle "
    "random re shutil socket sqlite3 ssl statistics string subprocess tarfile tempfile textwrap threading time "
    "typing unittest urllib.request zipfile"
).split()


def sentences(n: int = N_SENTENCES) -> list[str]:
    """``n`` English sentences from the docstrings of standard library modules
    and their public classes and functions, in a fixed order."""
    found: dict[str, None] = {}
    for name in _MODULES:
        module = importlib.import_module(name)
        public = [
            a for a in sorted(dir(module)) if not a.startswith("_") and not (name == "typing" and a in ("io", "re"))
        ]
        docs = [module.__doc__] + [getattr(module, a).__doc__ for a in public]  # typing.io/re: deprecated aliases
        for doc in docs:
            for s in re.split(r"(?<=[.!?])\s+", " ".join((doc if isinstance(doc, str) else "").split())):
                if 20 <= len(s) <= 400:
                    found[s] = None
    if len(found) < n:
        raise RuntimeError(f"only {len(found)} sentences in the standard library's docstrings")
    return list(found)[:n]


def engine_round(kit, texts: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    vectors = me.embed(kit, texts, batch_size=32, truncate=True).vectors
    return time.perf_counter() - start, vectors


def reference_round(python: str, model_dir: Path, texts_file: Path, tmp: Path) -> tuple[dict, np.ndarray]:
    out = tmp / "reference.npy"
    done = subprocess.run(
        [python, "-c", _REFERENCE, str(model_dir), str(texts_file), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-python", required=True, help="a Python with torch and sentence-transformers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    machine = machine_info()  # at the start: its load average is the one the run began under
    texts = sentences()
    model_dir = catalog.lookup(MODEL)
    t = time.perf_counter()
    kit = me.load_model(MODEL)
    engine_load = time.perf_counter() - t
    me.embed(kit, texts[:64])  # warm-up, as the reference side's
    ours, theirs, info = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        texts_file = Path(tmp) / "sentences.json"
        texts_file.write_text(json.dumps(texts))
        for _ in range(args.rounds):
            seconds, engine_vectors = engine_round(kit, texts)
            ours.append(seconds)
            info, reference_vectors = reference_round(args.reference_python, model_dir, texts_file, Path(tmp))
            theirs.append(info["seconds"])
    cos = (engine_vectors * reference_vectors).sum(1) / (
        np.linalg.norm(engine_vectors, axis=1) * np.linalg.norm(reference_vectors, axis=1)
    )
    tokens = me.embed(kit, texts, truncate=True).total_tokens
    result = {
        "machine": machine,
        "load_average_after": os.getloadavg(),  # other work on the machine slows both sides
        "sentences": len(texts),
        "tokens": tokens,
        "rounds": args.rounds,
        "engine_seconds": ours,
        "reference_seconds": theirs,
        "engine_per_s": len(texts) / statistics.median(ours),
        "reference_per_s": len(texts) / statistics.median(theirs),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "engine_load_s": engine_load,
        "reference_load_s": info["load_s"],
        "reference": {k: info[k] for k in ("torch", "sentence_transformers", "threads")},
    }
    result["speedup"] = result["engine_per_s"] / result["reference_per_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embeddings.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "embeddings.md").write_text(report(result))
    sys.stdout.write(report(result))


def report(r: dict) -> str:
    ref = r["reference"]
    return (
        f"# Embeddings: all-MiniLM-L6-v2, {r['sentences']} sentences ({r['tokens']} tokens), batch 32\n\n"
        "| | sentences/s (median of {n}) | rounds (s) | load (s) |\n|---|---|---|---|\n".format(n=r["rounds"])
        + f"| mlx-engine `embed` | {r['engine_per_s']:.0f} | {', '.join(f'{s:.2f}' for s in r['engine_seconds'])} "
        f"| {r['engine_load_s']:.2f} |\n"
        f"| sentence-transformers {ref['sentence_transformers']} (torch {ref['torch']}, {ref['threads']} threads) "
        f"| {r['reference_per_s']:.0f} | {', '.join(f'{s:.2f}' for s in r['reference_seconds'])} "
        f"| {r['reference_load_s']:.2f} |\n\n"
        f"Throughput ratio: {r['speedup']:.2f}x. Cosine between the two sides' vectors: "
        f"min {r['cosine_min']:.7f}, mean {r['cosine_mean']:.7f}. "
        f"Load average after the run: {', '.join(f'{x:.1f}' for x in r['load_average_after'])} "
        "(the machine's other work slows both sides).\n"
    )


if __name__ == "__main__":
    main()
