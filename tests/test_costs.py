"""Forward costs that stay true (pricing/costs.py, cost_book.py, cost_store.py):
a noisy measurement does not clamp wider widths, timed rounds move a wrong record
towards the truth and have it measured again, stale and hostile records are
misses, and the test run keeps its records out of the user's home. Timings are
injected (a fake clock, made-up rounds): nothing here depends on this machine's speed."""

import mlx_engine as me
from mlx_engine.kits.text import costs_from_record
from mlx_engine.pricing import cost_store, costs, fit
from mlx_engine.pricing.cost_book import BookSettings, CostBook

import os
import threading
from pathlib import Path

import pytest
from conftest import COST_DIR
from helpers import generate_ids

WIDTHS = range(1, costs.MAX_DRAFT + 2)


def truth(n: int) -> float:
    """Seconds of an n-token pass on the imagined machine: a jump from one token, then linear."""
    return 0.010 if n == 1 else 0.010 * (1.25 + 0.04 * n)


TRUE = costs.CostModel(tuple(truth(n) for n in WIDTHS))


def close_to_truth(cm: costs.CostModel, within: float) -> bool:
    return all(abs(cm.seconds[n - 1] / truth(n) - 1) <= within for n in WIDTHS)


def noisy_samples(spike_width: int | None = None) -> dict[int, list[float]]:
    """Five interleaved samples per measured width, +-4%; at ``spike_width`` every
    sample 3x (the machine busy for that stretch: its median is the spike)."""
    wiggle = (1.0, 1.04, 0.97, 1.02, 0.96)
    return {
        n: [truth(n) * w * (3.0 if n == spike_width else 1.0) for w in wiggle]
        for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 17, 25)
    }


def test_a_slow_width_does_not_clamp_every_wider_one():
    clean = costs.fit_widths(noisy_samples())
    assert close_to_truth(clean, 0.05) and fit.credible(noisy_samples())
    spiked = costs.fit_widths(noisy_samples(spike_width=12))
    assert list(spiked.seconds) == sorted(spiked.seconds)
    # A running maximum priced every width from 12 on at the spike (3x).
    assert close_to_truth(spiked, 0.05)
    for at in (10, 25):  # beside the widest, and the widest itself
        assert close_to_truth(costs.fit_widths(noisy_samples(spike_width=at)), 0.05)
    assert not fit.credible(noisy_samples(spike_width=12))  # so the measurement is repeated


def test_an_incredible_measurement_times_its_widths_again(llama_path):
    kit = me.load_model(llama_path)
    ticks = iter(range(10**6))
    durations = []

    def clock() -> float:
        # Each pass reads the clock twice; the first round's passes spread 1-3x, later ones agree.
        i = next(ticks)
        if i % 2 == 0:
            return float(i)
        spread = len(durations) < 6 * 11
        durations.append((3.0 if i % 4 == 1 else 1.0) if spread else 1.0)
        return i - 1 + durations[-1] * 1e-3

    m = costs.Measurement(kit.model, kit.vocab_size, context=8, repeats=5, attempts=3, clock=clock)
    while not m.step():
        pass
    assert m.rounds == 2 and m.description()["rounds"] == 2 and m.description()["credible"]
    assert all(len(xs) == 10 for xs in m.samples.values())
    me.unload(kit)


def rounds_of_a_request(i: int) -> list[tuple[int, float]]:
    """Ten timed rounds of request ``i`` on the imagined machine: mostly undrafted
    ones and lookup rounds of a few widths, +-8% noise and one stall (5x) each."""
    widths = (1, 1, 5, 1, 9, 17, 1, 3, 33, 1)
    noise = (1.0, 1.08, 0.93, 1.05, 0.95, 1.02, 0.92, 1.06, 0.97, 1.03)
    out = [(w, truth(w) * noise[(j + i) % 10]) for j, w in enumerate(widths)]
    out[i % 10] = (out[i % 10][0], out[i % 10][1] * 5.0)
    return out


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_requests(book: CostBook, count: int, clock: Clock, after=None) -> list[costs.CostModel]:
    """``count`` requests: each prices with ``book.current()``, then times its rounds."""
    seen = []
    for i in range(count):
        seen.append(book.current())
        for width, seconds in rounds_of_a_request(i):
            book.observe(width, seconds)
        clock.now += 30.0
        if after is not None:
            after(i)
    seen.append(book.current())
    return seen


def test_a_record_with_every_width_doubled_is_corrected_within_20_requests():
    doubled = costs.CostModel(tuple(2 * s for s in TRUE.seconds))
    saved, asked, clock = [], [], Clock()
    book = CostBook(doubled, "stored", {"measured_at": 1.0}, saved.append, lambda: asked.append(clock.now), clock)
    models = run_requests(book, 20, clock)
    # The rounds alone (the re-measurement never finishes here) bring it within 10%.
    assert close_to_truth(models[-1], 0.10)
    assert not close_to_truth(models[0], 0.5)
    # The record is re-measured once (the disagreement stays, but within the hour:
    # no second), and the stored record follows the rounds with when and how.
    assert len(asked) == 1
    assert saved and close_to_truth(costs_from_record(saved[-1]), 0.15)
    assert saved[-1]["measured_at"] == 1.0 and saved[-1]["refined"]["rounds"] > 0


def test_observed_rounds_move_a_spiked_record_towards_the_truth_and_trigger_a_measurement():
    # The record the issue found: widths from 12 on clamped to one slow sample (3.53 steps).
    spiked = costs.CostModel(tuple(truth(n) if n < 12 else 0.0353 for n in WIDTHS))
    asked, clock = [], Clock()
    book = CostBook(spiked, "stored", {}, lambda value: None, lambda: asked.append(clock.now), clock)
    before = [spiked.relative(n) / TRUE.relative(n) for n in (17, 33)]
    remeasured = []

    def measurement_finishes(i: int) -> None:
        if asked and not remeasured:  # the background measurement finishes before the next request
            remeasured.append(i)
            book.replace(TRUE, {"measured_at": clock.now})

    models = run_requests(book, 6, clock, measurement_finishes)
    assert asked and remeasured and remeasured[0] <= 3
    after = [models[-1].relative(n) / TRUE.relative(n) for n in (17, 33)]
    assert all(b > 1.3 for b in before) and all(abs(a - 1) < 0.1 for a in after)


def test_rounds_that_agree_with_the_record_neither_remeasure_nor_keep_rewriting_it():
    saved, asked, clock = [], [], Clock()
    book = CostBook(TRUE, "stored", {}, saved.append, lambda: asked.append(1), clock)
    models = run_requests(book, 20, clock)
    assert not asked and close_to_truth(models[-1], 0.08)
    # Rewritten only when a width moved by more than save_change (5%): noise does so rarely.
    assert len(saved) <= 1 and all(close_to_truth(costs_from_record(v), 0.08) for v in saved)


def test_a_record_is_measured_again_at_most_once_per_interval():
    slow = costs.CostModel(tuple(3 * s for s in TRUE.seconds))
    asked, clock = [], Clock()
    settings = BookSettings(remeasure_every_s=600.0)
    book = CostBook(slow, "stored", {}, lambda value: None, lambda: asked.append(clock.now), clock, settings)
    run_requests(book, 5, clock)
    assert len(asked) == 1
    book.replace(slow, {})  # measured again on a machine still busy: still 3x
    run_requests(book, 30, clock)  # 900 s later
    assert len(asked) == 2 and asked[1] - asked[0] >= 600.0


def test_an_estimate_is_refined_but_neither_stored_nor_measured_again():
    saved, asked, clock = [], [], Clock()
    book = CostBook(costs.estimate(0.02, "cpu"), "estimate", None, saved.append, lambda: asked.append(1), clock)
    run_requests(book, 10, clock)
    assert not saved and not asked
    assert abs(book.current().step() / truth(1) - 1) < 0.25  # the rounds' step, not the estimate's 2x


# -- the kit's cost records ---------------------------------------------------


def test_a_stale_record_is_ignored_and_rounds_reach_the_kits_book(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    kit = me.load_model(llama_path)
    key = kit.cost_key("forward")
    stale = {"seconds": [0.001 * n for n in WIDTHS], "version": costs.COST_MODEL_VERSION - 1}
    cost_store.save(key, stale)
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i, i * i)\n" * 8)
    generate_ids(kit, prompt, max_tokens=12, auto_speculative=True)
    assert kit.cost_source in ("estimate", "measured")  # the stale record was not used
    assert kit.cost_book.rounds and all(1 <= w <= costs.MAX_DRAFT + 1 for w, _ in kit.cost_book.rounds)
    me.unload(kit)


def test_fixed_length_lookup_rounds_reach_the_kits_book(llama_path, tmp_path, monkeypatch):
    """Not only auto's rounds: a prompt_lookup request's timed rounds refine the
    kit's forward costs too (each verified its drafts and the target's own token)."""
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    kit = me.load_model(llama_path, max_parallel=1)
    kit.forward_costs()  # the book is open (an earlier auto request, or a batching kit)
    before = len(kit.cost_book.rounds)
    prompt = me.tokenize(kit, "for i in range(10):\n    print(i, i * i)\n" * 8)
    _, final = generate_ids(kit, prompt, max_tokens=12, decoding="prompt_lookup", prompt_lookup_num_tokens=4)
    rounds = list(kit.cost_book.rounds)[before:]
    assert final.stats.decoding_mode == "prompt_lookup"
    assert rounds and all(1 <= w <= 5 for w, _ in rounds) and any(w > 1 for w, _ in rounds)
    me.unload(kit)


def hostile(kind: str, path: Path) -> None:
    if kind == "nested":
        path.write_text("[" * 60_000)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(path.with_name("gone.json"))


@pytest.mark.parametrize("kind", ["nested", "fifo", "dev-zero", "folder", "dangling"])
def test_a_hostile_cost_record_is_a_miss(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    key = {"kind": "forward"}
    cost_store.save(key, {"seconds": [1.0]})
    [path] = tmp_path.glob("*.json")
    path.unlink()
    hostile(kind, path)
    result = []
    reader = threading.Thread(target=lambda: result.append(cost_store.load(key)), daemon=True)
    reader.start()
    reader.join(60)  # the bound only turns a hang (a FIFO read) into a failure
    assert not reader.is_alive() and result == [None]


def test_an_auto_request_decodes_over_a_hostile_record(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    kit = me.load_model(llama_path)
    key = kit.cost_key("forward")
    cost_store.save(key, {"seconds": [1.0]})
    [path] = tmp_path.glob("*.json")
    path.write_text("[" * 60_000)  # a RecursionError in json.loads, once on every auto request
    prompt = me.tokenize(kit, "a b c a b c a b c")
    ids, final = generate_ids(kit, prompt, max_tokens=6, auto_speculative=True)
    plain, _ = generate_ids(kit, prompt, max_tokens=6)
    assert ids == plain and kit.cost_source in ("estimate", "measured")
    me.unload(kit)


def test_the_test_run_keeps_cost_records_out_of_the_users_home():
    where = cost_store.store_dir()
    assert where is not None and where == Path(COST_DIR)
    assert not where.resolve().is_relative_to(Path.home().resolve() / ".cache")


def wait_until(condition, timeout=120.0):
    """Poll ``condition``; the bound only turns a hang into a failure."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_a_kits_record_far_off_its_rounds_is_refined_saved_and_measured_again(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    kit = me.load_model(llama_path)
    key = kit.cost_key("forward")
    # A record claiming a second a step (a tiny model's real steps take milliseconds).
    absurd = {"seconds": [1.0 + 0.1 * n for n in range(len(WIDTHS))], "version": costs.COST_MODEL_VERSION}
    cost_store.save(key, {**absurd, "measured_at": 1.0})
    assert kit.forward_costs().step() == 1.0 and kit.cost_source == "stored"
    for i in range(4):  # what four requests' rounds timed (injected: no request runs)
        for width, seconds in rounds_of_a_request(i):
            kit.observe_round(width, seconds)
    refined = kit.forward_costs()
    assert refined.step() < 0.1  # the rounds' step, weighted 40 rounds to the record's 8
    wait_until(lambda: kit.cost_source == "measured")  # measured again between requests
    record = cost_store.load(key)
    assert record["measured_at"] > 1.0 and record["how"]["samples"] >= 5 * 11
    assert kit.cost_book.remeasures == 1
    me.unload(kit)


def test_a_kit_is_idle_only_with_no_request_open():
    from mlx_engine.kits.registry import Activity

    activity = Activity()
    activity.register("a")
    assert activity.idle_seconds() == 0.0  # open: never idle, however long ago one ended
    activity.end("a")
    ended = activity.last_end
    assert ended > 0 and activity.idle_seconds() >= 0.0
    activity.register("b")
    assert activity.idle_seconds() == 0.0 and activity.last_end == ended


def test_the_process_is_idle_only_with_no_kits_request_open():
    from mlx_engine.kits.registry import Activity, process_idle_seconds

    one, other = Activity(), Activity()
    one.end("never-opened")  # both have ended a request and have none open
    other.end("never-opened")
    assert process_idle_seconds([one, other]) > 0.0
    other.register("b")
    assert one.idle_seconds() > 0.0 and process_idle_seconds([one, other]) == 0.0  # another kit's request counts
    other.end("b")
    assert 0.0 < process_idle_seconds([one, other]) <= one.idle_seconds()  # since the later end: other's
    assert process_idle_seconds([]) == float("inf")


@pytest.mark.slow
def test_a_background_measurement_waits_for_another_kits_open_request(llama_path, tmp_path, monkeypatch):
    """A server hosting several models: an idle kit's passes are not timed beside another's stream."""
    from mlx_engine.kits.text import IDLE_GRACE_S

    import gc
    import time

    gc.collect()  # generators other tests dropped unclosed: their requests end now, not mid-test
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    busy, kit = me.load_model(llama_path), me.load_model(llama_path)
    prompt = me.tokenize(kit, "a b c a b c a b c")
    stream = me.create_generator(busy, prompt, max_tokens=100_000)
    next(stream)  # open and running on the other kit
    generate_ids(kit, prompt, max_tokens=3, auto_speculative=True)  # estimated; measurement queued
    assert kit.cost_source == "estimate"
    time.sleep(IDLE_GRACE_S + 1.5)  # a tiny model's whole measurement takes well under this once idle
    assert kit.cost_source == "estimate"
    stream.close()
    wait_until(lambda: kit.cost_source == "measured")
    me.unload(kit)
    me.unload(busy)


def test_unloading_a_kit_frees_the_model_its_waiting_measurement_held(llama_path, tmp_path, monkeypatch):
    """A measurement waiting for the process to go idle (a retry timer pending)
    lets go of the model and its scratch cache when the kit unloads, not at its
    next retry: an unload frees its memory when it returns."""
    import gc
    import weakref

    gc.collect()
    monkeypatch.setenv("MLX_ENGINE_COST_DIR", str(tmp_path))
    busy, kit = me.load_model(llama_path), me.load_model(llama_path)
    prompt = me.tokenize(kit, "a b c a b c a b c")
    stream = me.create_generator(busy, prompt, max_tokens=100_000)
    next(stream)  # another kit's request open: the measurement waits
    generate_ids(kit, prompt, max_tokens=3, auto_speculative=True)
    assert kit.cost_source == "estimate"
    model = weakref.ref(kit.model)
    me.unload(kit)
    gc.collect()
    assert model() is None
    stream.close()
    me.unload(busy)


def test_a_record_measured_while_busy_is_measured_again_once_it_is_old():
    clock = Clock()
    for age, expected in ((60.0, 0), (7200.0, 1)):
        asked = []
        record = {"measured_at": clock.now - age, "how": {"credible": False}}
        book = CostBook(TRUE, "stored", record, lambda value: None, lambda: asked.append(1), clock)
        run_requests(book, 3, clock)  # rounds that agree with it: only its doubt counts
        assert len(asked) == expected
