"""Per-step cost of the position-keyed sampler against mlx-lm's ``make_sampler``:
``python -m bench.sampler``. A benchmark, not a test (docs/decoding.md#seeds).

Times ``--calls`` evaluated sampling calls on a (rows, vocab) batch of
log-probabilities, interleaved in ``--repeats`` rounds, best and median per call.
"""

from __future__ import annotations

import mlx_engine  # noqa: F401  (first: loads OpenBLAS before mlx.core)
from mlx_engine.decode.sampling import SamplingParams, build_sampler  # noqa: E402

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

FILTERS = {"temp only": {}, "top-p, top-k, min-p": dict(top_p=0.9, top_k=50, min_p=0.02)}


def time_calls(fn: Callable[[], mx.array], calls: int) -> float:
    """Seconds per evaluated call."""
    t = time.perf_counter()
    for _ in range(calls):
        mx.eval(fn())
    return (time.perf_counter() - t) / calls


def compare(rows: int, vocab: int, filters: dict, calls: int, repeats: int) -> dict[str, list[float]]:
    lp = mx.random.normal((rows, vocab), key=mx.random.key(0))
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    mx.eval(lp)
    old = make_sampler(
        temp=0.8, top_p=filters.get("top_p", 0.0), top_k=filters.get("top_k", 0), min_p=filters.get("min_p", 0.0)
    )
    new = build_sampler(SamplingParams(temp=0.8, **filters), seed=7)
    fns = {"mlx-lm": lambda: old(lp), "position-keyed": lambda: new(lp, range(100, 100 + rows))}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        time_calls(fn, 10)  # warm-up (compilation)
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_calls(fn, calls))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 17])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for rows in args.rows:
        for label, filters in FILTERS.items():
            times = compare(rows, args.vocab, filters, args.calls, args.repeats)
            cells = [
                f"{name} {min(t) * 1e3:.2f} ms (median {sorted(t)[len(t) // 2] * 1e3:.2f})" for name, t in times.items()
            ]
            print(f"({rows}, {args.vocab}) {label}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
