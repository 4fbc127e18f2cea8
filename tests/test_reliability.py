"""The reliability suite (docs/reliability.md#the-reliability-suite).

Every test here is marked ``soak``. The default run (and CI) runs them at reduced
size; the full run is

    MLX_ENGINE_SOAK=1 .venv/bin/python -m pytest -m soak -s

which prints the figures (cancellations, generations, memory drift, fuzz cases).
No test asserts a time: rates are reported, not judged."""

from __future__ import annotations

import mlx_engine as me
from mlx_engine import CallbackError, GenerationInProgressError

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import pytest
from helpers import assert_same_or_near_tie, generate_ids

pytestmark = pytest.mark.soak
FULL = os.environ.get("MLX_ENGINE_SOAK") == "1"


def size(reduced: int, full: int) -> int:
    return full if FULL else reduced


def report(line: str) -> None:
    print(f"\n[reliability] {line}")


# -- cancellation at random points --------------------------------------------
MODES = {
    "plain": dict(speculative_decoding_toggle=False),
    "draft_fixed": dict(num_draft_tokens=3),
    "draft_adaptive": dict(),
    "prompt_lookup": dict(prompt_lookup_num_tokens=4, speculative_decoding_toggle=False),
    "auto": dict(auto_speculative=True),
}
ROUTES = ("close", "stop_generation", "progress_false", "callback_interrupt", "host_interrupt")


@dataclass
class Cancelled:
    route: str
    mode: str
    point: int


def cancel_once(kit, prompt, mode_kwargs, route, point, rng) -> None:
    """Start a generation and cancel it by ``route`` at ``point`` (tokens taken,
    or progress callbacks seen for the prompt-processing routes)."""
    if route in ("progress_false", "callback_interrupt"):
        calls = [0]

        def progress(_pct):
            calls[0] += 1
            if calls[0] > point:
                if route == "progress_false":
                    return False
                raise KeyboardInterrupt
            return True

        try:
            results = list(
                me.create_generator(kit, prompt, max_tokens=40, prompt_progress_callback=progress, **mode_kwargs)
            )
            assert results[-1].stop_condition is not None
        except KeyboardInterrupt:
            pass
        return
    request_id = f"r{rng.random()}"
    gen = me.create_generator(kit, prompt, max_tokens=10_000, request_id=request_id, **mode_kwargs)
    try:
        for i, result in enumerate(gen):
            if result.stop_condition is not None:
                return
            if i < point:
                continue
            if route == "close":
                gen.close()
            elif route == "stop_generation":
                t = threading.Thread(target=me.stop_generation, args=(kit, request_id))
                t.start()
                t.join()
                continue  # the generation ends with user_cancelled at the next step
            elif route == "host_interrupt":
                raise KeyboardInterrupt  # the host's code is interrupted between tokens
            return
    except KeyboardInterrupt:
        pass
    finally:
        del gen  # dropping an open iterator closes it on the kit's thread


@pytest.mark.slow
def test_cancellations_at_random_points_leave_output_equal_to_a_fresh_kit(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    fresh = me.load_model(llama_path)
    rng = random.Random(15)
    base = me.tokenize(kit, "for i in range(10):\n    print(i, i * i)\n" * 60)  # > 512 tokens: several prompt chunks
    prompts = [base, base[:300] + me.tokenize(kit, "class Point:\n"), me.tokenize(kit, "def add(a, b):\n")]
    refs = {i: generate_ids(fresh, p, max_tokens=12)[0] for i, p in enumerate(prompts)}
    done: list[Cancelled] = []
    for n in range(size(25, 200)):
        route, mode = ROUTES[n % len(ROUTES)], list(MODES)[(n // len(ROUTES)) % len(MODES)]
        which = rng.randrange(len(prompts))
        point = rng.randrange(4) if route in ("progress_false", "callback_interrupt") else rng.randrange(12)
        cancel_once(kit, prompts[which], MODES[mode], route, point, rng)
        assert not kit.worker.call(lambda: kit.activity.active)  # after any close queued by a dropped iterator
        ids, final = generate_ids(kit, prompts[which], max_tokens=12, **MODES[mode])
        assert len(ids) == 12 and final.stop_condition.stop_reason == "token_limit"
        assert_same_or_near_tie(fresh, prompts[which], refs[which], ids)
        done.append(Cancelled(route, mode, point))
    report(
        f"{len(done)} cancellations over {len(ROUTES)} routes x {len(MODES)} modes; output equal to a fresh kit's after each"
    )


def test_cancellations_on_a_vision_kit(tmp_path_factory):
    from fixtures.tiny_vlm import image_b64, make_qwen2_vl

    path = make_qwen2_vl(tmp_path_factory.mktemp("rel_vlm") / "qwen2_vl")
    kit, fresh = me.load_model(path), me.load_model(path)
    images = [image_b64((255, 0, 0)), image_b64((0, 0, 255), size=(48, 80))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = list(kit.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    refs = [generate_ids(fresh, prompt, max_tokens=8, images_b64=[img])[0] for img in images]
    rng = random.Random(7)
    n = size(10, 40)
    for i in range(n):
        route, which = ROUTES[i % len(ROUTES)], rng.randrange(len(images))
        gen_kwargs = dict(images_b64=[images[which]])
        cancel_once(kit, prompt, gen_kwargs, route, rng.randrange(3 if "progress" in route else 8), rng)
        ids, _ = generate_ids(kit, prompt, max_tokens=8, **gen_kwargs)
        assert ids == refs[which]
    report(f"{n} cancellations on a vision kit; output equal to a fresh kit's after each")


# -- memory and speed over many generations -------------------------------------
@pytest.mark.slow
def test_memory_is_flat_over_many_generations_and_draft_cycles(llama_path, draft_path):
    """Deterministic modes only (plain, fixed-length draft, prompt lookup), so that
    runs of the same kind have the same shape and any growth is a leak; the
    adaptive and auto modes' shapes follow timings."""
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    prompts = [
        me.tokenize(kit, t)
        for t in ("def add(a, b):\n", "class Point:\n    def __init__(self):\n", "for i in range(10):\n")
    ]
    modes = [MODES["plain"], MODES["draft_fixed"], MODES["prompt_lookup"]]
    n_gen, period, warm = size(135, 1008), 9, 18  # a run kind: prompt x mode; the draft reloads once a period
    active, peak, tps = {}, {}, []
    for i in range(n_gen + warm):
        if i % period == period - 1:
            me.unload_draft_model(kit)
            me.load_draft_model(kit, draft_path)
        _, final = generate_ids(kit, prompts[i % 3], max_tokens=16, **modes[(i // 3) % 3])
        if i >= warm:
            active.setdefault(i % period, []).append(mx.get_active_memory())
            peak.setdefault(i % period, []).append(final.stats.peak_memory)
            tps.append(final.stats.generation_tps)

    # Each kind of run: the median of its last third against that of its first
    # third after warm-up (peaks vary a little with how MLX overlaps evaluation;
    # a leak moves the median).
    def drift(series: list[int]) -> float:
        third = max(1, len(series) // 3)
        first, last = sorted(series[:third]), sorted(series[-third:])
        return last[len(last) // 2] / first[len(first) // 2] - 1

    active_drift = max(drift(v) for v in active.values())
    peak_drift = max(drift(v) for v in peak.values())
    a0, a1 = sum(v[0] for v in active.values()) / period, sum(v[-1] for v in active.values()) / period
    w = len(tps) // 10
    t0, t1 = sorted(tps[:w])[w // 2], sorted(tps[-w:])[w // 2]
    report(
        f"{n_gen} generations after {warm} warm-up, {(n_gen + warm) // period} draft unload/load cycles: "
        f"active memory {a0 / 2**20:.3f} -> {a1 / 2**20:.3f} MiB (largest median drift of a run kind {active_drift:+.2%}), "
        f"peak memory largest median drift {peak_drift:+.2%}; median tok/s first/last tenth {t0:.0f} / {t1:.0f}"
    )
    assert active_drift <= 0.02, "active memory grew over the run"
    assert peak_drift <= 0.02, "peak memory grew over the run"


# -- threads --------------------------------------------------------------------
def test_host_threads_share_a_kit_in_every_mode(llama_path, draft_path):
    kit = me.load_model(llama_path)
    on_ui = threading.Thread(target=me.load_draft_model, args=(kit, draft_path))
    on_ui.start()
    on_ui.join()
    prompt = me.tokenize(kit, "def add(a, b):\n")
    want = generate_ids(me.load_model(llama_path), prompt, max_tokens=6)[0]
    per_thread = size(6, 50)
    errors, busy = [], [0]

    def host(seed):
        """No host-side lock: a start while another runs is refused, and retried."""
        rng = random.Random(seed)
        for _ in range(per_thread):
            kwargs = MODES[rng.choice(list(MODES))]
            while True:
                try:
                    ids = generate_ids(kit, prompt, max_tokens=6, **kwargs)[0]
                    break
                except GenerationInProgressError:
                    busy[0] += 1
                    time.sleep(0.001)
            try:
                assert_same_or_near_tie(kit, prompt, want, ids)
            except AssertionError as exc:  # reported below
                errors.append(exc)

    threads = [threading.Thread(target=host, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    report(
        f"4 host threads x {per_thread} requests on one kit (all modes), {busy[0]} concurrent starts refused and retried"
    )


@pytest.mark.slow
def test_process_exit_after_threaded_work_never_aborts(tmp_path_factory, llama_path):
    from test_threads import run_exit_script

    from fixtures.tiny_models import make_model

    half = make_model(
        tmp_path_factory.mktemp("rel_half") / "half",
        "llama",
        hidden=64,
        layers=2,
        seed=1,
        tokenizer_from=llama_path,
        dtype=mx.float16,
    )
    runs = size(2, 20)
    for _ in range(runs):
        out = run_exit_script(half, 3)
        assert out.returncode == 0 and "done" in out.stdout, (out.returncode, out.stderr[-2000:])
    report(f"{runs} processes exited cleanly after threaded work, abandoned generations and a daemon generation")


# -- multi-user chat soak ------------------------------------------------------------
CHAT_SYSTEM = "You are a careful assistant. Answer briefly, in code when you can. " * 2
CHAT_ASKS = [
    "def add(a, b):",
    "class Point:",
    "import os",
    "for i in range(10):",
    "print(i, i * i)",
    "Hello world!",
    "The quick brown fox",
    "return a + b",
    "self.x = x",
    "Bonjour le monde.",
]
CHAT_REGEX = r"(yes|no), [a-z]{2,8}\."
BROKEN_REGEX = r"(zq|qz)[a-z]{30}"  # its matcher is made to fail mid-generation (break_matchers)


def break_matchers(monkeypatch) -> None:
    """Make the grammar matcher of every BROKEN_REGEX request fail at its third
    verify round, mid-generation, as a matcher failing at run time does."""
    from mlx_engine.structured import GrammarConstraint

    init, masks = GrammarConstraint.__init__, GrammarConstraint.masks

    def patched_init(self, kit, grammar, *args, **kwargs):
        init(self, kit, grammar, *args, **kwargs)
        self.soak_rounds_left = 3 if "zq|qz" in grammar else None

    def patched_masks(self, drafts):
        if self.soak_rounds_left is not None:
            self.soak_rounds_left -= 1
            if not self.soak_rounds_left:
                raise RuntimeError("structured output: the grammar matcher failed (injected)")
        return masks(self, drafts)

    monkeypatch.setattr(GrammarConstraint, "__init__", patched_init)
    monkeypatch.setattr(GrammarConstraint, "masks", patched_masks)


@dataclass
class ChatTurn:
    """One request of the soak, checked against the same prompt run alone afterwards."""

    user: int
    prompt: list[int]
    max_tokens: int
    kind: str
    ids: list[int]
    cancelled: str | None  # the route, when this turn was cancelled
    error: BaseException | None = None
    cache_source: str | None = None  # where its cached prefix came from (stats), when it ended with a result


class ChatUser:
    """One thread's conversation: turns of a random kind, some cancelled."""

    def __init__(self, kit, user: int, kinds_seen: Counter):
        self.kit, self.user, self.rng = kit, user, random.Random(1000 + user)
        self.messages = [{"role": "system", "content": CHAT_SYSTEM}]
        self.turns: list[ChatTurn] = []
        self.refused = 0
        self.kinds_seen = kinds_seen

    def request_kwargs(self, kind: str) -> dict:
        return {
            "default": {},  # with a draft loaded: the draft model, adaptive
            "plain": {"speculative_decoding_toggle": False},
            "lookup": {"prompt_lookup_num_tokens": 4},
            "draft": {"num_draft_tokens": 3},
            "auto": {"auto_speculative": True},
            "structured": {"regex": CHAT_REGEX},
            "faulty": {"stats_callback": _raising},  # fails by its own fault, at its end
            "broken": {"regex": BROKEN_REGEX, "structured_drafting": False},  # its matcher fails mid-generation
        }[kind]

    def turn(self) -> None:
        rng, kit = self.rng, self.kit
        if len(self.messages) > 1 and rng.random() < 0.15:
            self.messages = self.messages[:-2]  # regenerate: the same prompt again
        self.messages.append({"role": "user", "content": rng.choice(CHAT_ASKS)})
        prompt = me.apply_chat_template(kit, self.messages)
        kinds = ["default", "plain", "lookup", "auto", "structured", "faulty", "broken"] + (
            ["draft"] if kit.draft else []
        )
        kind = rng.choices(kinds, weights=[3, 3, 3, 2, 2, 1, 1] + ([3] if kit.draft else []))[0]
        route = rng.choice(["close", "stop_generation", "drop"]) if rng.random() < 0.25 else None
        max_tokens, cancel_at = rng.randint(3, 20), rng.randrange(8)
        request_id = f"u{self.user}-{len(self.turns)}"
        turn = ChatTurn(self.user, prompt, max_tokens, kind, [], None)
        self.turns.append(turn)
        self.kinds_seen[kind] += 1
        while True:
            try:
                gen = me.create_generator(
                    kit, prompt, max_tokens=max_tokens, request_id=request_id, **self.request_kwargs(kind)
                )
                break
            except GenerationInProgressError:  # max_parallel requests already open: retried
                self.refused += 1
                time.sleep(0.002)
        text = []
        try:
            for i, r in enumerate(gen):
                turn.ids += [t.id for t in r.tokens]
                text.append(r.text)
                if r.stats is not None:
                    turn.cache_source = r.stats.cache_source
                if route is not None and i == cancel_at and r.stop_condition is None:
                    turn.cancelled = route
                    if route == "close":
                        gen.close()
                    elif route == "stop_generation":
                        me.stop_generation(kit, request_id)  # False when it already ended (results still queued)
                    else:
                        break  # dropped below, unfinished
        except Exception as exc:  # checked at the end: only faulty and broken turns may fail, by their own fault
            turn.error = exc
        finally:
            del gen
        self.messages.append({"role": "assistant", "content": "".join(text)})


@pytest.mark.slow
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no finalizer may fail
def test_multi_user_chat_soak(llama_path, draft_path, tmp_path, monkeypatch):
    """4-8 users hold multi-turn chats sharing a system prompt on one kit
    (max_parallel=4, a disk tier under a tiny budget): random cancellations,
    structured-output, speculative and faulty requests mixed in, the draft
    model unloaded and reloaded between rounds. Every answer equals the same
    prompt run alone (a cancelled one, its prefix); only the faulty requests
    fail, each by its own fault; at the end nothing is left open and memory is
    back where it was."""
    import gc

    # One-offs are made before the baseline: each engine thread's first
    # generation keeps a few bytes for good (threads are pooled, never freed),
    # and this test holds two kits (two threads) at once.
    warm = [me.load_model(llama_path) for _ in range(2)]
    for k in warm:
        generate_ids(k, me.tokenize(k, "hi"), max_tokens=2)
        me.unload(k)
    del warm, k
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    n_users, rounds = size(6, 8), size(5, 50)
    break_matchers(monkeypatch)
    kit = me.load_model(
        llama_path,
        max_parallel=4,
        prompt_cache_dir=tmp_path / "cache",
        prompt_cache_bytes=128 * 2**10,
        prompt_cache_disk_bytes=256 * 2**10,
    )
    me.load_draft_model(kit, draft_path)
    draft_cycles = [0]

    def between_rounds() -> None:  # every user waits at the barrier: no generation is open
        if kit.draft is None:
            me.load_draft_model(kit, draft_path)
        else:
            me.unload_draft_model(kit)
        draft_cycles[0] += 1

    kinds_seen: Counter = Counter()
    users = [ChatUser(kit, u, kinds_seen) for u in range(n_users)]
    barrier = threading.Barrier(n_users, action=between_rounds, timeout=600)
    crashed: list[BaseException] = []

    def run(user: ChatUser) -> None:
        try:
            for _ in range(rounds):
                user.turn()
                barrier.wait()
        except BaseException as exc:  # reported below
            crashed.append(exc)
            barrier.abort()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1200)
    elapsed = time.perf_counter() - t0
    assert not crashed, crashed[:3]
    state = kit.worker.call(
        lambda: (
            set(kit.activity.known),
            set(kit.activity.active),
            kit.scheduler.live,
            kit.batch.rows,
            kit.prompt_cache.busy,
        )
    )
    assert state == (set(), set(), [], [], [])

    turns = [t for u in users for t in u.turns]
    failed = [t for t in turns if t.error is not None and t.kind not in ("faulty", "broken")]
    assert not failed, [(t.kind, repr(t.error)) for t in failed[:5]]
    assert all(isinstance(t.error, CallbackError) for t in turns if t.kind == "faulty" and not t.cancelled)
    assert all("injected" in str(t.error) for t in turns if t.kind == "broken" and t.error is not None)
    monkeypatch.undo()  # the broken requests' answers so far are checked against their regex run alone
    alone = me.load_model(llama_path, max_parallel=1)
    for t in turns:
        kw = (
            {"regex": {"structured": CHAT_REGEX, "broken": BROKEN_REGEX}[t.kind]}
            if t.kind in ("structured", "broken")
            else {}
        )
        want = generate_ids(alone, t.prompt, max_tokens=t.max_tokens, **kw)[0]
        partial = t.cancelled or t.error is not None  # a failed turn delivered the results before its error
        assert (len(t.ids) <= len(want)) if partial else (len(t.ids) == len(want)), (t, want)
        assert_same_or_near_tie(alone, t.prompt, want[: len(t.ids)], t.ids)
    n_requests, refused = len(turns), sum(u.refused for u in users)
    cancels = Counter(t.cancelled for t in turns if t.cancelled)
    own_failures = Counter(t.kind for t in turns if t.error is not None)
    sources = Counter(t.cache_source for t in turns if t.cache_source)
    me.unload(kit)
    me.unload(alone)
    kit = alone = users = turns = t = None  # released (between_rounds' cell holds kit too)
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - baseline
    report(
        f"multi-user chat soak: {n_users} users x {rounds} rounds = {n_requests} requests on max_parallel=4 "
        f"({dict(sorted(kinds_seen.items()))}); {sum(cancels.values())} cancelled ({dict(cancels)}), "
        f"failed by their own fault: {dict(own_failures)} (a raising stats_callback, a matcher failing), 0 by another's; {refused} starts "
        f"refused (max_parallel) and retried; {draft_cycles[0]} draft unload/load switches; cached prefixes "
        f"from {dict(sources)}; MLX memory after unload {held:+d} bytes against the start; {elapsed:.1f} s"
    )
    assert held <= 0, f"{held} bytes of MLX memory still held after unloading"


# -- property-based fuzzing -----------------------------------------------------

from mlx_engine.drafters.prompt_lookup import NGramIndex  # noqa: E402
from mlx_engine.request.stop_strings import StopStringMatcher  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = Counter()  # cases run per target, reported when the module's tests are done


@pytest.fixture(scope="module", autouse=True)
def fuzz_report():
    yield
    if FUZZ:
        total = sum(n for name, n in FUZZ.items() if ":" not in name)  # "target: outcome" entries break a target down
        report("fuzz cases run: " + ", ".join(f"{name} {n}" for name, n in FUZZ.items()) + f"; total {total}")


FUZZ_SETTINGS = settings(
    max_examples=size(30, 400),
    deadline=None,
    derandomize=not FULL,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CHEAP_SETTINGS = settings(max_examples=size(200, 3000), deadline=None, derandomize=not FULL)

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 500), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.tuples(st.integers()),
)


def _raising(_arg):
    raise RuntimeError("host callback bug")


CALLBACKS = st.sampled_from([None, lambda p: True, lambda p: False, lambda p: None, _raising, 3, "x"])
PLAUSIBLE = {
    "max_tokens": st.integers(1, 6),
    "temp": st.floats(0, 3),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 450),
    "min_p": st.floats(0, 1),
    "min_tokens_to_keep": st.integers(1, 5),
    "repetition_penalty": st.floats(0.1, 3),
    "repetition_context_size": st.integers(1, 64),
    "seed": st.integers(0, 2**64 - 1),
    "stop_strings": st.lists(st.text(max_size=3), max_size=3),
    "top_logprobs": st.integers(0, 21),
    "prompt_progress_callback": CALLBACKS,
    "stats_callback": CALLBACKS,
    "request_id": st.text(max_size=4),
    "num_draft_tokens": st.integers(0, 9),
    "speculative_decoding_toggle": st.sampled_from([None, True, False]),
    "prompt_lookup_num_tokens": st.integers(0, 9),
    "prompt_lookup_min_ngram": st.integers(0, 4),
    "prompt_lookup_max_ngram": st.integers(0, 4),
    "prompt_lookup_num_candidates": st.integers(0, 5),
    "auto_speculative": st.booleans(),
    "images_b64": st.one_of(st.none(), st.just([]), st.lists(st.text(max_size=8), max_size=2)),
}


@pytest.fixture(scope="module")
def fuzz_kit(llama_path, draft_path):
    kit = me.load_model(llama_path)
    me.load_draft_model(kit, draft_path)
    return kit


@pytest.mark.slow
@FUZZ_SETTINGS
@given(
    prompt=st.one_of(st.lists(st.integers(0, 400), min_size=1, max_size=24), JUNK),
    kwargs=st.fixed_dictionaries({}, optional={k: st.one_of(v, JUNK) for k, v in PLAUSIBLE.items()}),
)
def test_fuzz_every_create_generator_argument(fuzz_kit, prompt, kwargs):
    """Any combination of arguments ends in a ValueError at create_generator, a
    CallbackError from a raising callback, or a generation that ends properly;
    the kit is usable after each."""
    FUZZ["create_generator arguments"] += 1
    try:
        gen = me.create_generator(fuzz_kit, prompt, **kwargs)
    except ValueError:
        return
    try:
        for i, result in enumerate(gen):
            if result.stop_condition is not None or i >= 8:
                break
    except CallbackError:
        pass
    finally:
        gen.close()
    assert not fuzz_kit.activity.active and not fuzz_kit.activity.known


@CHEAP_SETTINGS
@given(
    pieces=st.lists(st.text(alphabet="ab\nx", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab\nx", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_fuzz_stop_strings_against_streamed_text(pieces, stops):
    """Streamed in any pieces, the text handed out is exactly the full text up to
    the first stop string, and never contains one."""
    FUZZ["stop strings over streamed text"] += 1
    matcher, out, found = StopStringMatcher(stops), [], None
    for piece in pieces:
        scan = matcher.feed(piece)
        out.append(scan.emit)
        assert not any(s in "".join(out) for s in stops)
        if scan.stop_string is not None:
            found = scan.stop_string
            break
    else:
        out.append(matcher.flush())
    # Oracle: after each piece, the earliest-starting stop string (longest on a
    # tie) completed anywhere in the text so far; the stream stops at the first
    # piece that completes one.
    text, expected, expected_stop = "", None, None
    for piece in pieces:
        text += piece
        hits = [(text.find(s), -len(s), s) for s in stops if s in text]
        if hits:
            start, _, expected_stop = min(hits)
            expected = text[:start]
            break
    emitted = "".join(out)
    assert found == expected_stop
    assert emitted == (text if expected is None else expected)


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_stop_strings_in_real_generations(fuzz_kit, data):
    """A stop string cut from the model's own output stops the stream exactly
    before its first occurrence."""
    FUZZ["stop strings in generations"] += 1
    prompt = data.draw(st.lists(st.integers(0, 390), min_size=1, max_size=12))
    results = list(me.create_generator(fuzz_kit, prompt, max_tokens=24, speculative_decoding_toggle=False))
    text = "".join(r.text for r in results)
    if len(text) < 2:
        return
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    results = list(
        me.create_generator(fuzz_kit, prompt, max_tokens=24, speculative_decoding_toggle=False, stop_strings=[stop])
    )
    streamed = "".join(r.text for r in results)
    assert results[-1].stop_condition.stop_reason == "stop_string" and results[-1].stop_condition.stop_string == stop
    assert streamed == text[: text.find(stop)]


@CHEAP_SETTINGS
@given(
    tokens=st.lists(st.integers(0, 5), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(0, 8),
    cands=st.integers(1, 5),
)
def test_fuzz_prompt_lookup_index_grows_like_it_was_built_at_once(tokens, cuts, min_n, extra, k, cands):
    FUZZ["prompt-lookup index"] += 1
    whole, grown = NGramIndex(min_n, min_n + extra), NGramIndex(min_n, min_n + extra)
    whole.extend(tokens)
    for cut in sorted(cuts) + [len(tokens)]:
        grown.extend(tokens[:cut])  # a growing history, as the decode loop passes it
        draft = grown.lookup(k, cands).drafts
        assert len(draft) <= k
    assert grown.tokens == whole.tokens and grown.lookup(k, cands) == whole.lookup(k, cands)


def _image_bytes(fmt: str, size_: tuple[int, int]) -> bytes:
    import io

    from PIL import Image

    img = Image.new("RGB", size_, (200, 30, 90))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims a size its (tiny) data does not have: a
    decompression bomb's signature."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    )


@FUZZ_SETTINGS
@given(
    fmt=st.sampled_from(["PNG", "JPEG", "WEBP", "GIF", "BMP"]),
    w=st.integers(1, 300),
    h=st.integers(1, 300),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.integers(0, 10**5), st.integers(0, 255)), max_size=3),
    bomb=st.one_of(st.none(), st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1))),
)
def test_fuzz_image_bytes(fmt, w, h, cut, flips, bomb):
    """Truncated, corrupted, zero-size and bomb images end in a ValueError naming
    images_b64[0], or decode to an image within the pixel limit."""
    from mlx_engine.kits.images import decode_images

    import base64

    FUZZ["image bytes"] += 1
    raw = bytearray(_png_claiming(*bomb) if bomb else _image_bytes(fmt, (w, h)))
    raw = raw[: max(1, int(len(raw) * cut))] if cut < 0.97 else raw
    for pos, value in flips:
        if pos < len(raw):
            raw[pos] = value
    try:
        (img,) = decode_images([base64.b64encode(bytes(raw)).decode()], max_pixels=10**6)
    except ValueError as exc:
        assert "images_b64[0]" in str(exc)
        return
    assert 0 < img.image.width * img.image.height <= 10**6


def test_fuzz_image_aspect_ratios_on_a_vision_kit(tmp_path_factory):
    """The model's image processor refuses extreme aspect ratios: named, early."""
    import base64

    from fixtures.tiny_vlm import make_qwen2_vl

    kit = me.load_model(make_qwen2_vl(tmp_path_factory.mktemp("rel_vlm_ar") / "q"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    prompt = list(kit.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    @FUZZ_SETTINGS
    @given(w=st.integers(1, 2000), h=st.integers(1, 40))
    def check(w, h):
        FUZZ["image aspect ratios (vision kit)"] += 1
        for size_ in ((w, h), (h, w)):
            image = base64.b64encode(_image_bytes("PNG", size_)).decode()
            try:
                gen = me.create_generator(kit, prompt, max_tokens=1, images_b64=[image])
            except ValueError as exc:
                assert "images_b64[0]" in str(exc)
                continue
            assert list(gen)[-1].stop_condition is not None

    check()


CONFIG_FIELDS = [
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rope_scaling",
    "text_config",
    "quantization",
]
CONFIG_VALUES = st.one_of(
    JUNK.filter(lambda v: not isinstance(v, bytes)),
    st.integers(0, 2**40),
    st.sampled_from(["llama", "qwen2", "cache", "mamba", ""]),
    st.dictionaries(
        st.sampled_from(["type", "factor", "rope_type", "bits", "group_size"]),
        st.one_of(st.integers(-2, 2**20), st.text(max_size=6)),
        max_size=3,
    ),
)
WEIGHT_CHANGES = ["drop_tensor", "extra_tensor", "transpose", "shrink", "nan", "inf", "dtype"]
LINK_CHANGES = ["loop", "dangling", "dev_zero", "to_file", "config_to_dir"]


def _mutate_weights(d, change: str, pick: int) -> None:
    weights = dict(mx.load(str(d / "model.safetensors")))
    name = sorted(weights)[pick % len(weights)]
    w = weights[name]
    if change == "drop_tensor":
        del weights[name]
    elif change == "extra_tensor":
        weights["model.layers.7.extra.weight"] = mx.zeros((3, 3))
    elif change == "transpose" and w.ndim == 2:
        weights[name] = w.T
    elif change == "shrink":
        weights[name] = w[: max(1, w.shape[0] - 1)]
    elif change in ("nan", "inf"):
        weights[name] = mx.full(w.shape, float(change), dtype=w.dtype)
    elif change == "dtype":
        weights[name] = w.astype(mx.int32)
    mx.save_safetensors(str(d / "model.safetensors"), weights)


def _mutate_links(d, change: str) -> None:
    target = d / "model.safetensors"
    if change == "config_to_dir":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
        return
    data = target.read_bytes()
    target.unlink()
    if change == "loop":
        target.symlink_to(target)
    elif change == "dangling":
        target.symlink_to(d / "gone.safetensors")
    elif change == "dev_zero":
        target.symlink_to("/dev/zero")
    else:
        (d / "blob").write_bytes(data)
        target.symlink_to(d / "blob")


@FUZZ_SETTINGS
@given(
    change=st.one_of(
        st.tuples(st.just("config"), st.sampled_from(CONFIG_FIELDS), CONFIG_VALUES),
        st.tuples(st.just("weights"), st.sampled_from(WEIGHT_CHANGES), st.integers(0, 10**6)),
        st.tuples(st.just("links"), st.sampled_from(LINK_CHANGES), st.just(0)),
    )
)
def test_fuzz_model_folders(llama_path, tmp_path_factory, change):
    """Hostile config fields, shape mismatches, NaN weights and symlinks: a
    ModelLoadError (or ValueError naming an argument), or a model that generates."""
    import json
    import shutil

    FUZZ["model folders"] += 1
    d = shutil.copytree(llama_path, tmp_path_factory.mktemp("fuzz_model") / "m")
    kind, what, value = change
    if kind == "config":
        cfg = json.loads((d / "config.json").read_text())
        cfg[what] = value
        (d / "config.json").write_text(json.dumps(cfg))
    elif kind == "weights":
        _mutate_weights(d, what, value)
    else:
        _mutate_links(d, what)
    try:
        kit = me.load_model(d)
    except ValueError:
        return
    results = list(me.create_generator(kit, [1, 2, 3], max_tokens=4))
    assert results[-1].stop_condition is not None


@pytest.fixture(scope="module")
def gguf_bytes(llama_path, tmp_path_factory):
    from fixtures.tiny_models import make_gguf

    return make_gguf(llama_path, tmp_path_factory.mktemp("rel_gguf") / "tiny.gguf").read_bytes()


@FUZZ_SETTINGS
@given(
    cut=st.one_of(st.none(), st.integers(0, 400_000)),
    flips=st.lists(st.tuples(st.integers(0, 4_000), st.integers(0, 255)), max_size=6),
    spans=st.lists(
        st.tuples(st.integers(0, 4_000), st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\x7f" * 4])), max_size=2
    ),
)
def test_fuzz_corrupt_gguf(gguf_bytes, tmp_path_factory, cut, flips, spans):
    """Truncated GGUF files and GGUF headers with flipped bytes or huge counts and
    lengths (0xff..): a ModelLoadError, or a model that generates; never a crash,
    hang or unbounded allocation."""
    FUZZ["corrupt GGUF"] += 1
    raw = bytearray(gguf_bytes if cut is None else gguf_bytes[:cut])
    for pos, value in flips:
        if pos < len(raw):
            raw[pos] = value
    for pos, span in spans:
        raw[pos : pos + len(span)] = span
    path = tmp_path_factory.mktemp("fuzz_gguf") / "m.gguf"
    path.write_bytes(bytes(raw))
    try:
        kit = me.load_model(path)
    except ValueError as exc:
        FUZZ[f"corrupt GGUF: refused ({type(exc).__name__})"] += 1
        return
    FUZZ["corrupt GGUF: loaded and generated"] += 1
    assert list(me.create_generator(kit, [1, 2, 3], max_tokens=3))[-1].stop_condition is not None
