"""The threading contract (docs/reliability.md): a host may load on one thread and
generate on others; the kit's MLX work runs on its own engine thread, so host
threads that exit, and process exit, never crash."""

import mlx_engine as me
from mlx_engine import GenerationInProgressError
from mlx_engine.runtime import worker as workers

import gc
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import generate_ids, wait_until

from fixtures.tiny_models import make_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def half_path(models_dir, llama_path):
    """A float16 model: compute_dtype='auto' upcasts it at load (set_dtype)."""
    return make_model(
        models_dir / "half",
        "llama",
        hidden=64,
        layers=2,
        scale=3.0,
        seed=1,
        tokenizer_from=llama_path,
        dtype=mx.float16,
    )


def on_thread(fn, *args, **kwargs):
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # reported to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("compute_dtype", ["auto", "native", "float32"])
def test_load_on_one_thread_generate_on_another(half_path, compute_dtype):
    kit = me.load_model(half_path, compute_dtype=compute_dtype)
    prompt = me.tokenize(kit, "def add(a, b):")
    ids = on_thread(lambda: generate_ids(kit, prompt, max_tokens=6)[0])
    assert ids == generate_ids(me.load_model(half_path, compute_dtype=compute_dtype), prompt, max_tokens=6)[0]


def test_model_loaded_on_a_thread_that_exits(half_path):
    kit = on_thread(me.load_model, half_path)
    prompt = me.tokenize(kit, "class Point:")
    assert len(generate_ids(kit, prompt, max_tokens=5)[0]) == 5


def test_draft_loaded_on_a_ui_thread_generates_on_a_worker(llama_path, draft_path):
    kit = me.load_model(llama_path)
    on_thread(me.load_draft_model, kit, draft_path)
    prompt = me.tokenize(kit, "for i in range(10):\n")
    ids, final = on_thread(generate_ids, kit, prompt, max_tokens=8, num_draft_tokens=2)
    assert final.stats.decoding_mode == "draft_model" and final.stats.drafted_tokens > 0
    assert ids == generate_ids(me.load_model(llama_path), prompt, max_tokens=8)[0]


def test_four_host_threads_share_one_kit(llama_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "Hello world!")
    want = generate_ids(kit, prompt, max_tokens=4)[0]
    lock = threading.Lock()
    got = []

    def host(n):
        for _ in range(n):
            with lock:  # a kit runs one generation at a time; the host serialises
                got.append(generate_ids(kit, prompt, max_tokens=4)[0])

    threads = [threading.Thread(target=host, args=(5,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == [want] * 20


def test_generation_abandoned_on_a_thread_that_exits(llama_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "def add(a, b):")
    holder = []

    def start():
        gen = me.create_generator(kit, prompt, max_tokens=50)
        next(gen)
        holder.append(gen)  # left open; the thread ends

    on_thread(start)
    with pytest.raises(GenerationInProgressError):
        me.unload(kit)  # the abandoned generation is still open
    holder.pop().close()
    assert (
        generate_ids(kit, prompt, max_tokens=4)[0] == generate_ids(me.load_model(llama_path), prompt, max_tokens=4)[0]
    )


def test_dropping_an_open_generator_frees_the_kit(llama_path):
    kit = me.load_model(llama_path)
    prompt = me.tokenize(kit, "def add(a, b):")
    gen = me.create_generator(kit, prompt, max_tokens=50)
    next(gen)
    del gen  # closed on the kit's thread when collected, without waiting
    me.unload_draft_model(kit)  # queued behind that close on the kit's thread: not refused
    assert generate_ids(kit, prompt, max_tokens=3)[1].stop_condition.stop_reason == "token_limit"
    gen = me.create_generator(kit, prompt, max_tokens=50)
    next(gen)
    del gen
    me.unload(kit)
    assert kit.model is None


def test_a_worker_back_in_the_pool_holds_nothing_of_its_last_kit():
    """A worker parks with no reference to the scheduler it last stepped: a
    kit's worker returns to the pool when the kit is gone, and whatever that
    scheduler held (arrays of its last batch) must go with the kit, not when
    the worker next gets work (the model host's memory test saw it come back
    during later loads)."""

    class Job:  # a scheduler as the worker sees one: ``busy`` and ``step``
        def __init__(self, steps: int):
            self.left, self.parked = steps, threading.Event()

        @property
        def busy(self) -> bool:
            if self.left == 0:
                self.parked.set()  # the worker has seen it idle and is about to park
            return self.left > 0

        def step(self) -> None:
            self.left -= 1

    worker = workers.acquire()
    job = Job(steps=3)
    worker.serve(job)
    worker.call(lambda: None)  # wakes the parked worker, which then steps the busy job
    assert job.parked.wait(30)
    workers.release(worker)
    gone = weakref.ref(job)
    del job
    gc.collect()
    wait_until(lambda: gone() is None, timeout=5)


def test_unload_during_a_generation_is_refused(llama_path):
    kit = me.load_model(llama_path)
    gen = me.create_generator(kit, me.tokenize(kit, "hello"), max_tokens=20)
    next(gen)
    with pytest.raises(GenerationInProgressError, match="finish or close it first"):
        me.unload(kit)
    assert kit.model is not None
    rest = list(gen)
    assert rest[-1].stop_condition.stop_reason == "token_limit"
    me.unload(kit)
    assert kit.model is None


EXIT_SCRIPT = r"""
import sys, threading
import mlx_engine as me

kit = me.load_model(sys.argv[1])                # loaded on the main thread
prompt = me.tokenize(kit, "def add(a, b):\n")
lock = threading.Lock()

def host():
    for _ in range(int(sys.argv[2])):
        with lock:
            list(me.create_generator(kit, prompt, max_tokens=8))

threads = [threading.Thread(target=host) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()

def abandon():                                    # a generation left open on a thread that exits
    gen = me.create_generator(kit, prompt, max_tokens=10_000)
    next(gen)
    abandoned.append(gen)

abandoned = []
t = threading.Thread(target=abandon); t.start(); t.join()
draft = me.load_model(sys.argv[1])                # a second kit, generated on a daemon thread at exit
threading.Thread(target=lambda: list(me.create_generator(draft, prompt, max_tokens=10_000)), daemon=True).start()
print("done", flush=True)
"""


def run_exit_script(model: Path, requests: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(model), str(requests)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
def test_process_exit_after_threaded_work_does_not_abort(half_path):
    """MLX's per-thread compile cache is torn down at thread exit and takes the GIL;
    on a host thread racing interpreter exit that aborted the process (exit 134).
    The engine runs MLX work on threads that never exit before the process does."""
    for _ in range(3):
        out = run_exit_script(half_path, 2)
        assert out.returncode == 0 and "done" in out.stdout, (out.returncode, out.stderr[-2000:])


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no finalizer may fail
@pytest.mark.parametrize("max_parallel", [1, 4])
@pytest.mark.slow
def test_ctrl_c_while_waiting_for_results_loses_none(llama_path, max_parallel):
    """Ctrl-C (SIGINT) arriving at random moments while the host is inside
    create_generator or next(): every interrupted call is simply made again; no
    result is lost, iteration ends (the end is never lost either), and no
    interrupted start leaves an open generation behind."""
    import gc
    import random
    import signal
    import time

    kit = me.load_model(llama_path, max_parallel=max_parallel)
    prompts = [me.tokenize(kit, t) for t in ("def add(a, b):\n", "class Point:\n", "import os\n")]
    jobs = [(prompts[i % 3], n) for i, n in enumerate([120, 3, 1, 60, 2, 5, 1, 30, 2, 1] * 2)]
    want = [generate_ids(kit, p, max_tokens=n)[0] for p, n in jobs]
    deadline = time.monotonic() + 120
    inside = [0]

    def handler(signum, frame):
        if time.monotonic() > deadline:
            raise TimeoutError("a stream blocked: its end was lost")
        f = frame
        while f is not None:  # only inside next() or create_generator: the test's own code is not interrupted
            if f.f_code.co_name in ("__next__", "create_generator") and f.f_code.co_filename.endswith(
                ("scheduler.py", "worker.py", "api.py")
            ):
                inside[0] += 1
                raise KeyboardInterrupt
            f = f.f_back

    stop = threading.Event()

    def interrupter():
        rng, main = random.Random(3), threading.main_thread().ident
        while not stop.is_set():
            time.sleep(rng.uniform(0, 0.002))
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, handler)
    sender = threading.Thread(target=interrupter, daemon=True)
    sender.start()
    got, caught = [], 0
    try:
        for p, n in jobs:
            while True:  # an interrupted start is started again
                try:
                    gen, ids = me.create_generator(kit, p, max_tokens=n), []
                    break
                except KeyboardInterrupt:
                    caught += 1
            while True:
                try:
                    r = next(gen)
                except StopIteration:
                    break
                except KeyboardInterrupt:
                    caught += 1
                    continue
                ids += [t.id for t in r.tokens]
            got.append(ids)
    finally:
        stop.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)
    assert caught == inside[0] > 0
    assert got == want
    gc.collect()
    assert not kit.activity.known  # interrupted starts left no open generation behind


@pytest.mark.parametrize("max_parallel", [1, 4])
def test_a_created_generator_counts_as_open_before_it_is_iterated(llama_path, draft_path, max_parallel):
    """A generator that exists but was never iterated is open: unloading the
    model or the draft under it is refused (iterating it later would find them
    gone); closing or dropping it frees the kit."""
    kit = me.load_model(llama_path, max_parallel=max_parallel)
    me.load_draft_model(kit, draft_path)
    prompt = me.tokenize(kit, "def add(a, b):")
    want = generate_ids(kit, prompt, max_tokens=5, num_draft_tokens=2)[0]
    gen = me.create_generator(kit, prompt, max_tokens=5, num_draft_tokens=2)
    for unload in (me.unload_draft_model, me.unload):
        with pytest.raises(GenerationInProgressError, match="finish or close it first"):
            unload(kit)
    with pytest.raises(GenerationInProgressError):
        me.load_draft_model(kit, draft_path)
    assert [t.id for r in gen for t in r.tokens] == want  # still served by the draft it was planned with
    gen = me.create_generator(kit, prompt, max_tokens=5)
    gen.close()
    me.unload_draft_model(kit)
    gen = me.create_generator(kit, prompt, max_tokens=5)
    del gen  # dropped unstarted: closed on the kit's thread before the next call
    me.unload(kit)
    assert kit.model is None and kit.draft is None


QUIET_EXIT_SCRIPT = r"""
import sys, threading, time
import mlx_engine as me

kits = [me.load_model(sys.argv[1], max_parallel=int(sys.argv[2])) for _ in range(2)]
prompt = me.tokenize(kits[0], "def add(a, b):\n")
started = threading.Event()

def consume(kit):                                 # still iterating when the process exits
    for i, _ in enumerate(me.create_generator(kit, prompt, max_tokens=100_000)):
        started.set()

def abandon():                                    # created, never iterated, on a thread that ended
    abandoned.append(me.create_generator(kits[1], prompt, max_tokens=10))

abandoned = []
threading.Thread(target=consume, args=(kits[0],), daemon=True).start()
t = threading.Thread(target=abandon); t.start(); t.join()
started.wait(60)
time.sleep(0.05)
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("max_parallel", [1, 4])
def test_process_exit_with_daemon_threads_iterating_is_quiet(llama_path, max_parallel):
    """At exit a daemon thread still iterating a generation sees its end; no
    thread prints an error (it used to be a RuntimeError traceback)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", QUIET_EXIT_SCRIPT, str(llama_path), str(max_parallel)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=env,
        )
        assert out.returncode == 0 and "done" in out.stdout, (out.returncode, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and "Error" not in out.stderr, out.stderr[-2000:]
