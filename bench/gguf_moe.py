"""Memory of quantized mixture-of-experts GGUF files once loaded (docs/gguf.md).

For each file, in a fresh process: the file's size and its expert tensors'
bytes; loaded with ``compute_dtype="native"`` (what a model too large for
float32 gets on the CPU), the bytes of every parameter and of the expert
parameters (MLX quantized arrays: codes, scales, biases), and MLX's active
memory after the load; then the same with the Metal rule forced
(``keep_quantized=True``: dense matrices re-quantized too, norms float16).

    python -m bench.gguf_moe [FILE ...]   # default: the MoE files in fixtures/gguf

Writes bench/results/gguf_moe.json and gguf_moe.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
FIXTURES = Path(__file__).parents[1] / "fixtures" / "gguf"
DEFAULT = [
    "qwen3moe-Q4_K_M.gguf",
    "gpt-oss-Q4_K_M.gguf",
    "gpt-oss-MXFP4_MOE.gguf",
    "qwen35moe-Q4_K_M.gguf",
    "qwen3next-Q4_K_M.gguf",
    "granitehybrid-moe-Q4_K_M.gguf",
]

_RUN = r"""
import json, sys
import mlx.core as mx
from mlx.utils import tree_flatten
import mlx_engine as me
from mlx_engine.loading.gguf import families, reader

path = sys.argv[1]
h = reader.read_header(__import__("pathlib").Path(path))
expert_file = sum(t.n_bytes for t in h.tensors.values() if t.name.endswith("_exps.weight"))
mx.reset_peak_memory()
kit = me.load_model(path, compute_dtype="native")
def arrays(model):  # the parameters and a kept MTP head (qwen35/qwen3next: resident too)
    mtp = getattr(model, "mtp", None)
    return tree_flatten(model.parameters()) + (list(mtp.weights.items()) if mtp is not None else [])
params = arrays(kit.model)
native = {"all": sum(v.nbytes for _, v in params), "experts": sum(v.nbytes for k, v in params if ".mlp.experts." in k or ".switch_mlp." in k),
          "active": mx.get_active_memory()}
metal = families.load_model(h, families.config_from_header(h), keep_quantized=True)
mparams = arrays(metal)
print(json.dumps({"file": h.path.stat().st_size, "expert_file": expert_file, "native": native,
                  "metal_all": sum(v.nbytes for _, v in mparams)}))
"""


def measure(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUN, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(paths: list[Path]) -> None:
    rows = {p.name: measure(p) for p in paths}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gguf_moe.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| file | file MB | experts in file MB | experts loaded MB (ratio) | all weights, native MB (ratio) | all weights, Metal rule MB (ratio) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        mb = 1e6
        n = r["native"]
        lines.append(
            f"| {name} | {r['file'] / mb:.2f} | {r['expert_file'] / mb:.2f} | {n['experts'] / mb:.2f} "
            f"({n['experts'] / r['expert_file']:.2f}x) | {n['all'] / mb:.2f} ({n['all'] / r['file']:.2f}x) | "
            f"{r['metal_all'] / mb:.2f} ({r['metal_all'] / r['file']:.2f}x) |"
        )
    (RESULTS / "gguf_moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]] or [FIXTURES / n for n in DEFAULT])
