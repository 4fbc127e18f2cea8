"""Fault injection for the prompt cache's disk tier (docs/reliability.md): failed
writes and a full disk, a removed or unwritable folder, corrupt and mismatched
entries, special files. Every request must answer exactly as a kit without a
disk tier does, and the kit must stay usable (more requests, then ``unload``)."""

import mlx_engine as me
from mlx_engine.caches import disk as disk_cache
from mlx_engine.loading import model as loading

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import generate_ids
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

A = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
B = "for i in range(10):\n    print(i, i * i)\n\nThe quick brown fox jumps over the lazy dog. "
ROOT = Path(__file__).resolve().parent.parent
HANG_LIMIT_S = 240  # a child process whose requests have not answered by then is stuck (it takes seconds)


def turn(kit, prompt):
    """One greedy request; ``prompt`` is text or token ids."""
    prompt = me.tokenize(kit, prompt) if isinstance(prompt, str) else prompt
    ids, last = generate_ids(kit, prompt, max_tokens=6, temp=0.0)
    return ids, last.stats


@pytest.fixture(scope="module")
def fresh(llama_path):
    """Output of a kit without a disk tier that has never cached anything."""
    seen = {}

    def run(prompt):
        key = prompt if isinstance(prompt, str) else tuple(prompt)
        if key not in seen:
            kit = me.load_model(llama_path)
            seen[key] = turn(kit, prompt)[0]
            me.unload(kit)
        return seen[key]

    return run


def disk_kit(llama_path, cache_dir, **kw):
    """A kit whose every other cached sequence spills to ``cache_dir``."""
    return me.load_model(llama_path, prompt_cache_dir=cache_dir, prompt_cache_bytes=0, **kw)


def temporaries(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.rglob("*") if ".tmp" in p.name]


def assert_usable(kit, fresh):
    """The kit answers another request exactly, then unloads."""
    assert turn(kit, B)[0] == fresh(B)
    me.unload(kit)
    assert kit.model is None and kit.cache is None


def stored_entry(llama_path, cache_dir, fresh):
    """A genuine entry for chat A (``unload`` writes it); returns its data file,
    its record, and the next turn of chat A, whose prompt extends the entry."""
    kit = disk_kit(llama_path, cache_dir)
    a1, _ = turn(kit, A)
    me.unload(kit)
    (record,) = cache_dir.rglob("*.json")
    data = record.with_suffix(".safetensors")
    assert data.is_file()
    prompt = me.tokenize(kit, A) + a1 + me.tokenize(kit, "\n# next\n")
    fresh(prompt)
    return data, record, prompt


def rewrite_record(record: Path, data: Path, **fields) -> None:
    """Make ``record`` match ``data`` (size and checksum), so that only the
    checks past the checksum can refuse the entry."""
    meta = json.loads(record.read_text())
    payload = data.read_bytes() if data.is_file() else b""
    meta.update(sha256=hashlib.sha256(payload).hexdigest(), bytes=len(payload))
    meta.update(fields)
    record.write_text(json.dumps(meta))


def forge_layers(data: Path, record: Path, change) -> None:
    """Replace the entry's layers with ``change(layers)``, keeping a valid checksum."""
    layers = load_prompt_cache(str(data))
    mx.eval([c.state[:2] for c in layers])
    save_prompt_cache(str(data), change(layers))
    rewrite_record(record, data)


def with_keys(layers, f):
    """Each layer with ``f`` applied to its keys and values."""
    for c in layers:
        c.keys, c.values = f(c.keys), f(c.values)
    return layers


def failing_writer(code: int, partial: bool):
    def write(path, layers, metadata=None):
        if partial:
            Path(path).write_bytes(b"\0" * 100)  # what a full disk leaves behind
        raise OSError(code, os.strerror(code))

    return write


# -- writes that fail -----------------------------------------------------------
@pytest.mark.parametrize(
    "code, partial",
    [(errno.ENOSPC, True), (errno.EACCES, False), (errno.EROFS, False)],
    ids=["disk-full", "permission", "read-only-fs"],
)
def test_a_failed_write_is_logged_and_skipped(llama_path, tmp_path, fresh, caplog, monkeypatch, code, partial):
    monkeypatch.setattr(disk_cache, "save_prompt_cache", failing_writer(code, partial))
    kit = disk_kit(llama_path, tmp_path)
    a, _ = turn(kit, A)
    b, _ = turn(kit, B)  # evicts chat A: its write fails
    assert (a, b) == (fresh(A), fresh(B))
    assert "could not write" in caplog.text and os.strerror(code) in caplog.text
    assert turn(kit, A)[0] == fresh(A)
    me.unload(kit)  # the flush fails too: the model is unloaded all the same
    assert kit.model is None and kit.cache is None
    assert not temporaries(tmp_path) and not list(tmp_path.rglob("*.safetensors"))


def test_failed_writes_in_parallel_requests(llama_path, tmp_path, fresh, monkeypatch):
    monkeypatch.setattr(disk_cache, "save_prompt_cache", failing_writer(errno.ENOSPC, True))
    kit = disk_kit(llama_path, tmp_path, max_parallel=2)
    turn(kit, "class Stack:\n    pass\n")
    for _ in range(2):  # every slot is released after each round, whatever the writes did
        gens = [me.create_generator(kit, me.tokenize(kit, p), max_tokens=6, temp=0.0) for p in (A, B)]
        outs = [[t.id for r in g for t in r.tokens] for g in gens]
        assert outs == [fresh(A), fresh(B)]
    assert not temporaries(tmp_path)
    me.unload(kit)
    assert kit.model is None


CHILD = """
import json, resource, signal, sys
import mlx_engine as me
args = json.loads(sys.argv[1])
if args.get("memory") and sys.platform.startswith("linux"):  # a reader that never stops fails instead of swapping
    resource.setrlimit(resource.RLIMIT_AS, (args["memory"], resource.getrlimit(resource.RLIMIT_AS)[1]))
kit = me.load_model(args["model"], prompt_cache_dir=args["dir"], prompt_cache_bytes=0)
if args.get("file_size"):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG), not the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (args["file_size"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
out = []
for p in args["prompts"]:
    results = list(me.create_generator(kit, p if isinstance(p, list) else me.tokenize(kit, p), max_tokens=6, temp=0.0))
    out.append([[t.id for r in results for t in r.tokens], results[-1].stats.cache_source])
me.unload(kit)
print(json.dumps({"outputs": out, "unloaded": kit.model is None and kit.cache is None}))
"""


def run_child(llama_path, cache_dir, prompts, **limits):
    """Greedy requests for ``prompts`` on a disk-tier kit in another process
    (under ``limits``: file_size, memory), then ``unload``: its report and its log.
    A process, so that a request stuck in a read (a FIFO, /dev/zero) fails the
    test instead of the whole suite."""
    args = json.dumps({"model": str(llama_path), "dir": str(cache_dir), "prompts": prompts, **limits})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_LIMIT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the requests did not answer within {HANG_LIMIT_S} s (stuck reading the cache folder?)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no file-size limit on this OS")
def test_a_full_disk(llama_path, tmp_path, fresh):
    """A real failing write: the process may not write files past 2 KiB."""
    result, log = run_child(llama_path, tmp_path, [A, B, A], file_size=2048)
    assert [ids for ids, _ in result["outputs"]] == [fresh(A), fresh(B), fresh(A)] and result["unloaded"]
    assert "could not write" in log
    assert not temporaries(tmp_path) and not list(tmp_path.rglob("*.safetensors"))


def test_the_folder_removed_while_running(llama_path, tmp_path, fresh):
    kit = disk_kit(llama_path, tmp_path)
    a1, _ = turn(kit, A)
    shutil.rmtree(tmp_path)
    assert turn(kit, B)[0] == fresh(B)  # evicts chat A: written to the folder made again
    restarted = disk_kit(llama_path, tmp_path)
    prompt = me.tokenize(kit, A) + a1 + me.tokenize(kit, "\n# next\n")
    ids, s = turn(restarted, prompt)
    assert ids == fresh(prompt) and s.cache_source == "disk"
    shutil.rmtree(tmp_path)
    assert_usable(kit, fresh)
    assert_usable(restarted, fresh)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs POSIX permissions (root ignores them)")
def test_an_unwritable_folder(llama_path, tmp_path, fresh, caplog):
    tmp_path.chmod(0o500)
    try:
        kit = disk_kit(llama_path, tmp_path)
        assert "not writable" in caplog.text
        assert [turn(kit, p)[0] for p in (A, B)] == [fresh(A), fresh(B)]
        assert_usable(kit, fresh)
    finally:
        tmp_path.chmod(0o700)
    assert not temporaries(tmp_path)


def test_a_corrupt_entry_that_cannot_be_deleted_is_ignored(llama_path, tmp_path, fresh, caplog, monkeypatch):
    """A read-only folder as root sees it: the corrupt entry stays on disk, so
    it is ignored for the kit's lifetime (warned about once, never read again)."""
    data, record, prompt = stored_entry(llama_path, tmp_path, fresh)
    _flip_a_byte(data, record)
    unlink = Path.unlink

    def refuse(path, *args, **kw):
        if tmp_path in path.parents and not path.name.startswith("."):  # entries, not temporaries
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return unlink(path, *args, **kw)

    monkeypatch.setattr(Path, "unlink", refuse)
    kit = disk_kit(llama_path, tmp_path)
    for _ in range(2):
        ids, s = turn(kit, prompt)
        assert ids == fresh(prompt) and s.cache_source == "none"
        kit.prompt_cache.clear()  # the next request looks in the folder again
    assert caplog.text.count("corrupt or mismatched entry") == 1 and "cannot delete" in caplog.text
    assert data.exists() and record.exists()
    monkeypatch.undo()
    assert_usable(kit, fresh)


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda p: p.write_text("x") and p, "is not a directory"),
        (lambda p: p.write_text("x") and p / "cache", "cannot be created"),
    ],
    ids=["a-file", "under-a-file"],
)
def test_a_bad_prompt_cache_dir_is_refused_before_loading(llama_path, tmp_path, monkeypatch, make, problem):
    def never(*args, **kw):
        raise AssertionError("weights were read before prompt_cache_dir was checked")

    monkeypatch.setattr(loading, "load_weights", never)
    with pytest.raises(ValueError, match=f"prompt_cache_dir .* {problem}"):
        me.load_model(llama_path, prompt_cache_dir=make(tmp_path / "f"))


# -- corrupt and mismatched entries -------------------------------------------
def _flip_a_byte(data, record):
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF
    data.write_bytes(bytes(raw))


def _garbage(data, record):
    data.write_bytes(os.urandom(data.stat().st_size))
    rewrite_record(record, data)


def _huge_header(data, record):
    data.write_bytes((2**40).to_bytes(8, "little") + data.read_bytes()[8:])
    rewrite_record(record, data)


def _tokens_not_matching_the_name(data, record):
    meta = json.loads(record.read_text())
    rewrite_record(record, data, tokens=meta["tokens"][:-1])


CORRUPTIONS = {
    "bad-hash": _flip_a_byte,
    "truncated": lambda data, record: data.write_bytes(data.read_bytes()[:-100]),
    "garbage-file": _garbage,
    "header-larger-than-file": _huge_header,
    "wrong-heads": lambda d, r: forge_layers(d, r, lambda ls: with_keys(ls, lambda a: mx.concatenate([a, a], axis=1))),
    "wrong-head-dim": lambda d, r: forge_layers(d, r, lambda ls: with_keys(ls, lambda a: a[..., :-1])),
    "wrong-dtype": lambda d, r: forge_layers(d, r, lambda ls: with_keys(ls, lambda a: a.astype(mx.float16))),
    "fewer-layers": lambda d, r: forge_layers(d, r, lambda ls: ls[:-1]),
    "fewer-positions": lambda d, r: forge_layers(d, r, lambda ls: [_shorten(c, 2) for c in ls]),
    "wrong-offset": lambda d, r: forge_layers(d, r, lambda ls: [_set_offset(c, c.offset - 2) for c in ls]),
    "record-not-json": lambda data, record: record.write_text("{not json"),
    "record-tokens-not-matching": _tokens_not_matching_the_name,
    "record-negative-size": lambda data, record: rewrite_record(record, data, bytes=-1),
}


def _shorten(c, n):
    c.keys, c.values, c.offset = c.keys[..., :-n, :], c.values[..., :-n, :], c.offset - n
    return c


def _set_offset(c, offset):
    c.offset = offset
    return c


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_or_mismatched_entry_is_deleted_and_never_used(llama_path, tmp_path, fresh, caplog, corruption):
    data, record, prompt = stored_entry(llama_path, tmp_path, fresh)
    CORRUPTIONS[corruption](data, record)
    kit = disk_kit(llama_path, tmp_path)
    ids, s = turn(kit, prompt)
    assert ids == fresh(prompt) and s.cache_source == "none"
    assert "corrupt or mismatched entry" in caplog.text
    assert not data.exists() and not record.exists()
    assert_usable(kit, fresh)


def test_an_oversized_record_is_not_read(llama_path, tmp_path, fresh, caplog, monkeypatch):
    data, record, prompt = stored_entry(llama_path, tmp_path, fresh)
    monkeypatch.setattr(disk_cache, "MAX_RECORD_BYTES", record.stat().st_size - 1)
    kit = disk_kit(llama_path, tmp_path)
    ids, s = turn(kit, prompt)
    assert ids == fresh(prompt) and s.cache_source == "none"
    assert "more than the" in caplog.text and not record.exists()
    assert_usable(kit, fresh)


# -- special files --------------------------------------------------------------
def _fifo(path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this OS")
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero on this OS")
    path.unlink()
    path.symlink_to("/dev/zero")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["record", "data"])
@pytest.mark.parametrize("special", [_fifo, _dev_zero], ids=["fifo", "link-to-dev-zero"])
def test_special_files_are_never_read(llama_path, tmp_path, fresh, which, special):
    data, record, prompt = stored_entry(llama_path, tmp_path, fresh)
    target = record if which == "record" else data
    if which == "data":
        rewrite_record(record, Path("/nonexistent"))  # a record claiming 0 bytes, as /dev/zero's size reads
    special(target)
    result, log = run_child(llama_path, tmp_path, [prompt, B], memory=8 * 2**30)
    assert result == {"outputs": [[fresh(prompt), "none"], [fresh(B), "none"]], "unloaded": True}
    assert "not a regular file" in log
    assert not os.path.lexists(target)  # the name is removed (a link, never what it points to)
