"""Resident memory of a quantized mixture-of-experts GGUF file once loaded,
against the file's size (issue 53's goal: within 15%; docs/gguf.md).

The fixtures in fixtures/gguf are mostly dense tensors (bench/gguf_moe.py);
this makes a qwen3moe file shaped as real MoE files are, its experts nearly all
of its weights: hidden 512, 4 layers, 48 experts of width 256 (4 used), random
weights written as llama.cpp's converter writes them
(fixtures/gguf_families.py), quantized to Q4_K_M by llama.cpp
(``--llama-cpp-python`` names a Python with llama-cpp-python). Then, in a fresh
process, it loads the file with ``compute_dtype="native"`` (what a model whose
float32 weights do not fit gets on the CPU: dense tensors float32), and in
another with the Metal rule forced (``keep_quantized=True``: dense matrices
re-quantized, the rest float16; the model only), and reads the process's resident
memory (``/proc/self/status``: anonymous and file-backed) before and after,
with MLX's cache cleared, MLX's active and peak memory, and the weights' bytes.

    python -m bench.gguf_moe_rss --llama-cpp-python /work/llamacpp-venv/bin/python
    python -m bench.gguf_moe_rss FILE ...     # measure existing files

Writes bench/results/gguf_moe_rss.json and gguf_moe_rss.md.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIG = dict(
    model_type="qwen3_moe", hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
    tie_word_embeddings=False, num_experts=48, num_experts_per_tok=4, moe_intermediate_size=256,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
)  # fmt: skip

_QUANTIZE = r"""
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""

_RUN = r"""
import ctypes, gc, json, os, sys
import mlx.core as mx
from mlx.utils import tree_flatten
import mlx_engine as me

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

def settled():
    gc.collect(); mx.clear_cache()
    return status()

def load(path, metal):
    if not metal:
        return me.load_model(path, compute_dtype="native").model
    from mlx_engine.loading.gguf import families, reader  # the Metal rule forced: dense matrices re-quantized
    h = reader.read_header(__import__("pathlib").Path(path))
    return families.load_model(h, families.config_from_header(h), keep_quantized=True)

path, warmup, metal = sys.argv[1], sys.argv[2], sys.argv[3] == "metal"
load(warmup, metal)  # the imports a load makes (tokenizer, model classes) not counted
before = settled()
model = load(path, metal)
after = settled()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # what glibc keeps of the load's freed buffers, handed back
trimmed = status()
params = tree_flatten(model.parameters())
from mlx_engine.loading.gguf import reader
h = reader.read_header(__import__("pathlib").Path(path))
expert_file = sum(t.n_bytes for t in h.tensors.values() if t.name.endswith("_exps.weight"))
print(json.dumps({"file": os.path.getsize(path), "expert_file": expert_file, "before": before, "after": after, "trimmed": trimmed,
                  "active": mx.get_active_memory(), "peak": mx.get_peak_memory(),
                  "weights": sum(v.nbytes for _, v in params),
                  "experts": sum(v.nbytes for k, v in params if ".switch_mlp." in k)}))
"""


def make_file(out: Path, llama_cpp_python: str) -> Path:
    """The qwen3moe F32 file (random weights, fixtures' converter), then llama.cpp's Q4_K_M of it."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from fixtures.gguf_families import arch_metadata, bpe_metadata, gguf_tensors, write_gguf

    out.mkdir(parents=True, exist_ok=True)
    (out / "bpe").mkdir(exist_ok=True)
    tok = bpe_metadata(out / "bpe")
    config = dict(CONFIG, vocab_size=len(tok["tokenizer.ggml.tokens"]))
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(0)
    params = []
    for name, w in tree_flatten(model.parameters()):
        noise = rng.standard_normal(w.shape, dtype=np.float32)
        scale = 0.1 if name.endswith("norm.weight") else 0.25 if "embed" in name else 1 / math.sqrt(w.shape[-1])
        params.append((name, mx.array(noise * scale + (1.0 if name.endswith("norm.weight") else 0.0))))
    model.load_weights(params)
    metadata = {"general.name": "bench-qwen3moe", **arch_metadata("qwen3moe", config), **tok}
    src = write_gguf(out / "qwen3moe-bench-F32.gguf", "qwen3moe", gguf_tensors(model, config, "qwen3moe"), metadata)
    del model, params
    dst = out / "qwen3moe-bench-Q4_K_M.gguf"
    subprocess.run([llama_cpp_python, "-c", _QUANTIZE, str(src), str(dst)], check=True, capture_output=True)
    src.unlink()
    return dst


def measure(path: Path, mode: str) -> dict:
    """``mode``: "native" (the kit, as the CPU loads it) or "metal" (the model
    with the Metal rule forced)."""
    warmup = Path(__file__).parents[1] / "fixtures" / "gguf" / "qwen3moe-Q4_K_M.gguf"
    args = [sys.executable, "-c", _RUN, str(path), str(warmup), mode]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python (to make the file)")
    args = parser.parse_args()
    files = args.files or [make_file(Path(tempfile.mkdtemp()), args.llama_cpp_python or parser.error("no file"))]
    rows = {f"{p.name} ({mode})": measure(p, mode) for p in files for mode in ("native", "metal")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf_moe_rss.json").write_text(json.dumps(rows, indent=1))
    mb = 1e6
    lines = [
        "| file | file MB | resident added by the load MB (anonymous, file-backed; ratio) | the same after "
        "malloc_trim MB (ratio) | MLX active MB (ratio) | MLX peak MB | weights MB | experts MB (in the file) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        d = {k: r["after"][k] - r["before"][k] for k in r["after"]}
        t = r["trimmed"]["VmRSS"] - r["before"]["VmRSS"]
        lines.append(
            f"| {name} | {r['file'] / mb:.1f} | {d['VmRSS'] / mb:.1f} ({d['RssAnon'] / mb:.1f}, "
            f"{d['RssFile'] / mb:.1f}; {d['VmRSS'] / r['file']:.2f}x) | {t / mb:.1f} ({t / r['file']:.2f}x) | "
            f"{r['active'] / mb:.1f} ({r['active'] / r['file']:.2f}x) | {r['peak'] / mb:.1f} | "
            f"{r['weights'] / mb:.1f} | {r['experts'] / mb:.1f} ({r['expert_file'] / mb:.1f}) |"
        )
    (RESULTS / "gguf_moe_rss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
