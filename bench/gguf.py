"""GGUF loading and decoding across tensor types (docs/gguf.md).

The default model's weights (SmolLM2-135M-Instruct, shipped as Q4_1) are
re-encoded as F16 and Q8_0 with llama.cpp's ``gguf`` package, and as Q4_K_M by
llama.cpp's own quantizer when ``--llama-cpp-python`` names a Python with
``llama-cpp-python`` installed. For each file, in a fresh process: load time,
peak memory during the load (MLX's allocator peak, the numpy/Python peak
traced by ``tracemalloc``, and the resident-set growth, which this machine's
proactive page reclaim can understate), greedy decode tokens/s (the engine
dequantizes every type to float32 on the CPU, so decode speed should be the
same within noise); and, with ``--llama-cpp-python``, llama.cpp itself on the
same file and prompt for reference (not a goal: MLX's CPU backend is not what
this engine is tuned for).

    python -m bench.gguf [--llama-cpp-python /work/llamacpp-venv/bin/python] [--tokens 64] [--llama-cpp-threads 2]

Writes bench/results/gguf.json and gguf.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "Explain in three sentences why the sky is blue."

_ENGINE_RUN = (
    r"""
import json, resource, sys, time, tracemalloc
import mlx_engine as me
import mlx.core as mx
path, n, trace = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "trace"
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mx.reset_peak_memory()
if trace:  # a separate run: tracing every allocation slows the load several times
    tracemalloc.start()
t = time.perf_counter(); kit = me.load_model(path); load_s = time.perf_counter() - t
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
numpy_peak, mlx_peak, weights = tracemalloc.get_traced_memory()[1], mx.get_peak_memory(), mx.get_active_memory()
tracemalloc.stop()
prompt = me.apply_chat_template(kit, [{"role": "user", "content": %r}])
last = None
for last in me.create_generator(kit, prompt, max_tokens=n, temp=0.0):
    pass
print(json.dumps({"load_s": load_s, "peak_rss_mib": peak_kib / 1024, "mlx_peak_mib": mlx_peak / 2**20,
                  "numpy_peak_mib": numpy_peak / 2**20, "weights_mib": weights / 2**20, "decode_tok_s": last.stats.generation_tps,
                  "tokens": last.stats.generated_tokens, "compute_dtype": str(kit.compute_dtype)}))
"""
    % PROMPT
)

_LLAMA_CPP_RUN = (
    r"""
import json, sys, time
from llama_cpp import Llama
path, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
messages = [{"role": "user", "content": %r}]
first, count = None, 0
for chunk in llm.create_chat_completion(messages, max_tokens=n, temperature=0.0, stream=True):
    if chunk["choices"][0]["delta"].get("content"):
        count += 1
        first = first or time.perf_counter()
print(json.dumps({"tokens": count, "decode_s": time.perf_counter() - first}))
"""
    % PROMPT
)

_QUANTIZE = r"""
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3]); params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def reencode(src: Path, dst: Path, qtype: str) -> Path:
    """``src`` with every matrix decoded and re-encoded as ``qtype`` by the
    ``gguf`` package (vectors stay F32); metadata copied as it is."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch=str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    t = gguf.GGMLQuantizationType[qtype]
    for tensor in reader.tensors:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if w.ndim == 1:
            writer.add_tensor(tensor.name, w.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(tensor.name, w.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(w, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _run(python: str, script: str, *args) -> dict:
    out = subprocess.run([python, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed (llama.cpp reference)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--llama-cpp-threads",
        type=int,
        default=2,
        help="llama.cpp's threads; its OpenMP workers spin-wait, so on a loaded machine 1 is steadier",
    )
    args = parser.parse_args()
    from mlx_engine.loading import catalog

    source = catalog.lookup(catalog.DEFAULT_MODEL)
    work = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    files = {"Q4_1 (shipped)": source}
    for qtype in ("F16", "Q8_0"):
        files[qtype] = reencode(source, work / f"smollm2-{qtype}.gguf", qtype)
    if args.llama_cpp_python:  # llama.cpp's own K-quant mix, from the F16 file
        dst = work / "smollm2-Q4_K_M.gguf"
        subprocess.run(
            [args.llama_cpp_python, "-c", _QUANTIZE, files["F16"], dst, "LLAMA_FTYPE_MOSTLY_Q4_K_M"], check=True
        )
        files["Q4_K_M (llama.cpp)"] = dst
    rows = []
    for label, path in files.items():
        memory = _run(sys.executable, _ENGINE_RUN, path, 1, "trace")
        row = {
            "file": label,
            "size_mb": path.stat().st_size / 1e6,
            **_run(sys.executable, _ENGINE_RUN, path, args.tokens, "time"),
        }
        row.update({k: memory[k] for k in ("peak_rss_mib", "mlx_peak_mib", "numpy_peak_mib", "weights_mib")})
        if args.llama_cpp_python:
            ref = _run(args.llama_cpp_python, _LLAMA_CPP_RUN, path, args.tokens, args.llama_cpp_threads)
            row["llama_cpp_tok_s"] = (ref["tokens"] - 1) / ref["decode_s"]  # after the first token, as the engine's
            row["llama_cpp_tokens"] = ref["tokens"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| file | MB | load s | weights MiB | MLX peak MiB | numpy peak MiB | RSS growth MiB | engine tok/s | llama.cpp tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = f"{r['llama_cpp_tok_s']:.1f}" if "llama_cpp_tok_s" in r else "-"
        lines.append(
            f"| {r['file']} | {r['size_mb']:.0f} | {r['load_s']:.2f} | {r['weights_mib']:.0f} | {r['mlx_peak_mib']:.0f} | "
            f"{r['numpy_peak_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['decode_tok_s']:.1f} | {ref} |"
        )
    (RESULTS / "gguf.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
