"""Sharded kits (docs/distributed.md): 2 ranks on loopback with the ring backend.

The jobs run tests/sharded_job.py in subprocesses, started by mlx.launch (as a
host would) or directly with MLX_RANK / MLX_HOSTFILE when a test must kill or stop
one rank."""

import mlx_engine as me
from mlx_engine.distributed import control, sharding

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_same_or_near_tie, generate_ids

from fixtures.tiny_models import make_model

pytestmark = pytest.mark.slow  # subprocesses: every test starts Python (and MLX) anew


JOB = Path(__file__).with_name("sharded_job.py")
LAUNCH = Path(sys.executable).with_name("mlx.launch")
JOB_TIMEOUT = 120


def free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free: mlx.launch gives rank i port p+i."""
    for _ in range(50):
        start = free_ports(1)[0]
        socks = []
        try:
            socks = [socket.create_server(("127.0.0.1", start + i)) for i in range(n)]
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def clean_env() -> dict:
    """The environment without MLX's job variables (the engine's own, such as
    the test run's MLX_ENGINE_COST_DIR, kept: a job must not store costs in the
    user's home); the jobs import this checkout's mlx_engine (not whichever one
    the interpreter has installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_") or k.startswith("MLX_ENGINE_")}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the job with mlx.launch: 2 ranks, ring backend, loopback."""
    port = free_port_run(2)
    cmd = [
        str(LAUNCH),
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(port),
        "--python",
        sys.executable,
        str(JOB),
        *args,
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)


def spawn(tmp_path: Path, per_rank_args: list[list[str]]) -> list[subprocess.Popen]:
    """Start one process per rank ourselves, so a test can kill or stop one."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(len(per_rank_args))]))
    procs = []
    for rank, args in enumerate(per_rank_args):
        env = clean_env() | {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), *args],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = JOB_TIMEOUT) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            out.append(p.communicate()[0])
    return out


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


# -- exactness ----------------------------------------------------------------
@pytest.fixture(scope="module")
def ministral3_path(models_dir, llama_path):
    """A model mlx-lm shards by pipeline (model.model.pipeline), sharing the llama fixture's tokenizer."""
    return make_model(
        models_dir / "ministral3", "ministral3", hidden=64, layers=3, scale=3.0, seed=6, tokenizer_from=llama_path
    )


@pytest.mark.parametrize("arch, parallelism", [("llama", "tensor"), ("ministral3", "pipeline")])
def test_two_ranks_match_one_rank_in_every_mode(tmp_path, request, draft_path, arch, parallelism):
    model = request.getfixturevalue(f"{arch}_path")
    out = tmp_path / "modes.json"
    run = launch(tmp_path, str(model), "--draft", str(draft_path), "--out", str(out), "--parallelism", parallelism)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert "crash" not in result, result.get("crash")
    assert result["shard"] == {"size": 2, "parallelism": parallelism}
    follower = json.loads(Path(f"{out}.rank1").read_text())
    assert follower["reason"] == "stopped"

    kit = me.load_model(model)
    from sharded_job import ECHO, N_ECHO, N_PROMPT, REGEX

    prompt, echo = me.tokenize(kit, ECHO), me.tokenize(kit, ECHO * 8)
    plain = generate_ids(kit, prompt, max_tokens=N_PROMPT, temp=0.0)[0]
    constrained, final = generate_ids(kit, prompt, max_tokens=24, temp=0.0, regex=REGEX)
    assert result["regex"]["stop"] == final.stop_condition.stop_reason == "grammar_complete"
    assert_same_or_near_tie(kit, prompt, constrained, result["regex"]["ids"])
    plain_echo = generate_ids(kit, echo, max_tokens=N_ECHO, temp=0.0)[0]
    assert result["after_reset"]["ids"] == result["plain"]["ids"][:4]
    for mode in ("plain", "plain_again", "after_cancel", "draft", "draft_adaptive"):
        assert_same_or_near_tie(kit, prompt, plain, result[mode]["ids"])
    for mode in ("lookup", "auto_lookup", "auto_draft"):
        assert_same_or_near_tie(kit, echo, plain_echo, result[mode]["ids"])
    # Each mode really ran as named, with the prompt cache reused.
    assert result["plain_again"]["cached"] > 0
    assert result["lookup"]["mode"] == "prompt_lookup" and result["lookup"]["drafted"] > 0
    assert result["auto_lookup"]["mode"].startswith("auto:")
    assert result["draft"]["mode"] == "draft_model" and result["draft"]["drafted"] > 0
    assert result["auto_draft"]["mode"].startswith("auto:")
    assert follower["passes"] == result["passes_total"] > 0  # the follower mirrored every pass
    # ... and freed the caches rank 0 freed (resets, cost-measurement scratch caches): at most
    # the kit's cache and one freed since the last message remain.
    assert follower["caches"] <= 2


# -- faults ---------------------------------------------------------------------
def _fault_job(tmp_path, llama_path, heartbeat: float, *extra: str):
    out = tmp_path / "wait.json"
    args = [str(llama_path), "--out", str(out), "--scenario", "wait", "--heartbeat-timeout", str(heartbeat), *extra]
    procs = spawn(tmp_path, [args, args])
    wait_for(out.with_suffix(".ready"))
    time.sleep(0.5)  # a generation is under way
    return out, procs


def test_killed_rank_makes_rank0_raise(tmp_path, llama_path):
    out, procs = _fault_job(tmp_path, llama_path, heartbeat=10.0)
    out.with_suffix(".killed").write_text(str(time.monotonic()))
    procs[1].send_signal(signal.SIGKILL)
    logs = wait_all(procs, timeout=60)
    result = json.loads(out.read_text())
    assert result.get("type") == "ShardedKitError", (result, logs[0])
    assert result["seconds_after_kill"] < 30
    assert not result["usable"]
    assert "unusable" in result["again"] and "Relaunch" in result["again"]


@pytest.mark.parametrize("shutdown", [True, False], ids=["socket-shutdown", "grace-only"])
def test_stopped_rank_makes_rank0_raise(tmp_path, llama_path, shutdown):
    """A rank that is alive but silent (SIGSTOP): MLX would wait forever; the
    heartbeat timeout turns it into an error, by shutting down the ring sockets or,
    where that is not possible, by releasing the host after ABORT_GRACE while the
    engine thread stays blocked (the kit can still be unloaded)."""
    out, procs = _fault_job(tmp_path, llama_path, 2.0, *([] if shutdown else ["--no-socket-shutdown"]))
    out.with_suffix(".killed").write_text(str(time.monotonic()))
    procs[1].send_signal(signal.SIGSTOP)
    try:
        logs = wait_all(procs[:1], timeout=60)
    finally:
        procs[1].kill()
        wait_all(procs[1:])
    result = json.loads(out.read_text())
    assert result.get("type") == "ShardedKitError", (result, logs[0])
    assert "hung or stopped" in result["error"]
    assert result["seconds_after_kill"] < 30
    assert not result["usable"]


@pytest.mark.parametrize(
    "where, timeouts", [("while-loading", ["--heartbeat-timeout", "2"]), ("before-control", ["--connect-timeout", "2"])]
)
def test_rank_stopped_during_the_load_fails_it_within_the_timeouts(tmp_path, llama_path, where, timeouts):
    """A follower stopped (SIGSTOP) while the model loads: rank 0 used to wait inside
    an MLX collective for ever; the heartbeats (or, before the control channel is
    up, the connect_timeout watchdog) turn it into a DistributedConfigError."""
    out = tmp_path / "load.json"
    args = [str(llama_path), "--out", str(out), "--stall-rank1", where, *timeouts]
    procs = spawn(tmp_path, [args, args])
    try:
        logs = wait_all(procs[:1], timeout=60)
    finally:
        procs[1].kill()
        wait_all(procs[1:])
    error_file = Path(f"{out}.rank0.error")
    assert error_file.exists(), logs[0]
    error = json.loads(error_file.read_text())
    assert error["type"] == "DistributedConfigError", error
    assert "hung or stopped" in error["error"], error


def test_killed_rank0_releases_the_follower(tmp_path, llama_path):
    out, procs = _fault_job(tmp_path, llama_path, heartbeat=10.0)
    procs[0].send_signal(signal.SIGKILL)
    wait_all(procs, timeout=60)
    follower = json.loads(Path(f"{out}.rank1").read_text())
    assert follower["reason"] == "failed" and follower["passes"] > 0
    assert "connection to a peer was lost" in follower["detail"] or "rank 0 closed" in follower["detail"]


# -- configuration ----------------------------------------------------------------
def test_one_rank_is_refused(llama_path):
    with pytest.raises(me.DistributedConfigError, match="at least 2 processes"):
        me.load_sharded_model(llama_path)


def _errors(tmp_path: Path, out: Path) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.error").read_text()) for r in range(2)]


def test_mismatched_model_files_are_refused(tmp_path, llama_path, models_dir):
    other = make_model(
        models_dir / "llama-other", "llama", hidden=64, layers=2, scale=3.0, seed=9, tokenizer_from=llama_path
    )
    out = tmp_path / "mismatch.json"
    wait_all(spawn(tmp_path, [[str(llama_path), "--out", str(out)], [str(other), "--out", str(out)]]))
    for err in _errors(tmp_path, out):
        assert err["type"] == "DistributedConfigError"
        assert "differ between ranks" in err["error"] and "ranks [0]" in err["error"] and "ranks [1]" in err["error"]


def test_unshardable_model_is_refused(tmp_path, models_dir, llama_path):
    odd = make_model(
        models_dir / "llama-3heads",
        "llama",
        hidden=48,
        layers=2,
        heads=3,
        kv_heads=3,
        scale=3.0,
        seed=5,
        tokenizer_from=llama_path,
    )
    out = tmp_path / "odd.json"
    wait_all(spawn(tmp_path, [[str(odd), "--out", str(out)]] * 2))
    for err in _errors(tmp_path, out):
        assert err["type"] == "DistributedConfigError"
        assert "num_attention_heads = 3 is not divisible by 2" in err["error"] and "no pipeline()" in err["error"]


def test_missing_model_on_one_rank_fails_every_rank(tmp_path, llama_path):
    out = tmp_path / "missing.json"
    wait_all(spawn(tmp_path, [[str(llama_path), "--out", str(out)], [str(tmp_path / "nowhere"), "--out", str(out)]]))
    for err in _errors(tmp_path, out):
        assert err["type"] == "DistributedConfigError"
        assert "rank 1:" in err["error"] and "does not exist" in err["error"]


# -- pieces ---------------------------------------------------------------------
def test_fingerprint_sees_content_names_and_sampled_blocks(tmp_path, llama_path):
    base = sharding.fingerprint(llama_path)
    assert base == sharding.fingerprint(llama_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in llama_path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert sharding.fingerprint(copy) == base
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-5] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert sharding.fingerprint(copy) != base
    big = tmp_path / "big.gguf"
    big.write_bytes(b"\0" * (40 << 20))
    sampled, full = sharding.fingerprint(big), sharding.fingerprint(big, full=True)
    with open(big, "r+b") as f:  # a byte outside every sampled block
        f.seek((1 << 20) + 12345)
        f.write(b"\1")
    assert sharding.fingerprint(big) == sampled and sharding.fingerprint(big, full=True) != full


def test_parallelism_choice(llama_path):
    from mlx_lm.utils import load_model

    model, config = load_model(llama_path, lazy=True)
    assert sharding.choose_parallelism(model, config, 2, "auto") == "tensor"
    with pytest.raises(me.DistributedConfigError, match="no pipeline"):
        sharding.choose_parallelism(model, config, 2, "pipeline")
    with pytest.raises(me.DistributedConfigError, match="num_key_value_heads = 2 is not divisible by 4"):
        sharding.choose_parallelism(model, config, 4, "auto")


def test_break_ring_sockets_touches_only_hostfile_addresses(tmp_path, monkeypatch):
    ring = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    ring_client = socket.create_connection(ring.getsockname())
    other_client = socket.create_connection(other.getsockname())
    ring_peer, other_peer = ring.accept()[0], other.accept()[0]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{ring.getsockname()[1]}"], ["127.0.0.1:1"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert control.rank0_host() == "127.0.0.1"
    assert control.break_ring_sockets() >= 2  # the listener and the accepted connection; the client's peer is it too
    assert ring_client.recv(1) == b""  # shut down: the peer sees end of stream
    other_client.sendall(b"x")
    assert other_peer.recv(1) == b"x"  # untouched
    for s in (ring, other, ring_client, other_client, ring_peer, other_peer):
        s.close()


def test_demo_runs_under_mlx_launch(tmp_path, llama_path):
    """demo.py under mlx.launch: rank 0 answers and prints the stats, rank 1 serves and exits cleanly."""
    demo = Path(__file__).resolve().parents[1] / "demo.py"
    port = free_port_run(2)
    cmd = [
        str(LAUNCH),
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(port),
        "--python",
        sys.executable,
        str(demo),
        "--model",
        str(llama_path),
        "--no-chat-template",
        "--prompt",
        "def add(a, b):",
        "--max-tokens",
        "8",
        "--prompt-lookup-num-tokens",
        "4",
    ]
    run = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("Generation stats") == 1, run.stdout + run.stderr  # only rank 0 prints
    assert "Decoding: prompt_lookup" in run.stdout
    assert "exited with code" not in run.stderr  # mlx.launch reports a rank that failed


def test_control_channel_refuses_strangers_and_reports_silence_and_exit():
    server = control.ControlServer("127.0.0.1", followers=2, token=42, heartbeat_timeout=1.0)
    stranger = socket.create_connection(("127.0.0.1", server.port))
    stranger.sendall(control._HELLO.pack(41, 1))  # wrong token
    silent = control.ControlClient("127.0.0.1", server.port, 42, 1, timeout=5)  # never beats
    beating = control.ControlClient("127.0.0.1", server.port, 42, 2, timeout=5)
    beating.start(on_lost=lambda: None)
    server.accept(timeout=10)
    assert sorted(server._conns) == [1, 2]
    assert stranger.recv(1) == b""  # closed by rank 0
    failures = []
    server.watch(failures.append)
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.1)
    assert failures == [failures[0]] and failures[0].startswith("rank 1 sent no heartbeat")
    for s in (stranger,):
        s.close()
    silent.close()
    beating.close()

    server = control.ControlServer("127.0.0.1", followers=1, token=7, heartbeat_timeout=30.0)
    client = control.ControlClient("127.0.0.1", server.port, 7, 1, timeout=5)
    client.start(on_lost=lambda: None)
    server.accept(timeout=10)
    failures = []
    server.watch(failures.append)
    client.close()  # the follower's process is gone
    deadline = time.monotonic() + 10
    while not failures and time.monotonic() < deadline:
        time.sleep(0.1)
    assert failures and "exited or was killed" in failures[0]
