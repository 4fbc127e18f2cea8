"""The server as a host of several models (mlx_engine/server/hosting/host.py,
docs/server.md "Several models" and "Metrics"): models found in a folder and
served by name, loaded on demand while others stream, unloaded by TTL and by
the memory budget (never a busy one), load failures kept to their own
requests, and ``GET /metrics`` checked against the requests' own usage.
Tiny random models over a real socket (uvicorn in a thread)."""

import mlx_engine as me
from mlx_engine.server import create_app
from mlx_engine.server.hosting.discovery import KnownModel, scan_models_dir
from mlx_engine.server.hosting.host import ModelHost
from mlx_engine.server.hosting.options import HostLimits, LoadOptions

import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from helpers import free_port, serve, settled_active_memory, wait_until
from prometheus_client.parser import text_string_to_metric_families

from fixtures.tiny_models import make_gguf, make_model

KEY = "host-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


NO_EOS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def no_eos(llama_path):
    """The fixtures' end tokens, banned in long streams (alpha and beta share the tokenizer)."""
    kit = me.load_model(llama_path, vocab_only=True)
    NO_EOS.update({str(t): -100 for t in kit.eos_token_ids})


@pytest.fixture(scope="module")
def host_dir(tmp_path_factory, llama_path, qwen_path) -> Path:
    """alpha (a llama folder), beta (a qwen2 folder), gamma.gguf (llama as GGUF),
    lab/delta (LM Studio's publisher/model layout, a GGUF inside)."""
    root = tmp_path_factory.mktemp("host_models")
    (root / "alpha").symlink_to(llama_path, target_is_directory=True)
    (root / "beta").symlink_to(qwen_path, target_is_directory=True)
    make_gguf(llama_path, root / "gamma.gguf")
    make_gguf(llama_path, root / "lab" / "delta" / "delta-Q8.gguf")
    (root / "lab" / "delta" / "mmproj-delta.gguf").write_bytes(b"GGUF")  # a vision projector: not a model
    (root / "notes").mkdir()  # neither a model nor holding any
    return root


class GatedLoader:
    """The host's loader behind a gate a test opens, counting the loads."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[str] = []
        self.host: ModelHost | None = None

    def __call__(self, model, options):
        self.calls.append(model.id)
        self.gate.wait(60)
        return self.host.load_kit(model, options)


def make_host(root, *, loader=None, **limits) -> ModelHost:
    host = ModelHost(
        models_dirs=[root],
        catalog=False,
        defaults=LoadOptions(max_parallel=2),
        limits=HostLimits(**limits),
        loader=loader,
    )
    if loader is not None:
        loader.host = host
    return host


def chat(url, model, text="Hello there", **extra):
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, headers=AUTH, timeout=120)


def state(url, model) -> str:
    return httpx.get(f"{url}/v1/models/{model}", headers=AUTH).json()["state"]


def scrape(url) -> dict:
    """``GET /metrics`` parsed by prometheus_client: {(sample name, labels as a sorted tuple): value}."""
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


class Streamer:
    """A long streamed chat in a thread, counting its content chunks; ``close`` leaves it."""

    def __init__(self, url, model, max_tokens=4000):
        self.chunks, self.status, self.done = 0, None, threading.Event()
        self._stop = threading.Event()
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell a very long story"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "logit_bias": NO_EOS,  # no early stop
        }
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url, body):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if self._stop.is_set():
                    break
                if line.startswith("data: {") and '"content"' in line and '"content": ""' not in line:
                    self.chunks += 1
        self.done.set()

    def close(self):
        self._stop.set()
        self.thread.join(60)


# -- discovery ------------------------------------------------------------------------------
def test_models_dir_layouts_are_found_by_name(host_dir):
    found = {m.id: m for m in scan_models_dir(host_dir)}
    assert set(found) == {"alpha", "beta", "gamma", "lab/delta"}
    assert found["alpha"].kind == "directory" and found["gamma"].kind == "gguf"
    assert found["lab/delta"].source.endswith("delta-Q8.gguf")  # the projector beside it is not the model
    assert found["alpha"].size_bytes > 0


def test_load_options_are_checked():
    with pytest.raises(ValueError, match="max_parallel"):
        LoadOptions(max_parallel=0)
    with pytest.raises(ValueError, match="context"):
        LoadOptions(context="big")
    with pytest.raises(ValueError, match="ttl"):
        HostLimits(ttl=-1)
    with pytest.raises(ValueError, match="memory_bytes"):
        HostLimits(memory_bytes=0)
    for bad in ({}, {"a": "not a kit"}, ["a list"]):
        with pytest.raises(ValueError, match="kit must be"):
            create_app(bad)


# -- serving several models ------------------------------------------------------------------
@pytest.mark.slow
def test_two_models_served_by_one_server(host_dir, llama_path, qwen_path):
    host = make_host(host_dir)
    with serve(create_app(host, api_key=KEY)) as url:
        listed = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
        assert {m["id"]: m["state"] for m in listed} == {
            "alpha": "not_loaded",
            "beta": "not_loaded",
            "gamma": "not_loaded",
            "lab/delta": "not_loaded",
        }
        answers = {m: chat(url, m) for m in ("alpha", "beta", "lab/delta")}
        for model, path in (("alpha", llama_path), ("beta", qwen_path)):
            kit = me.load_model(path)
            prompt = me.apply_chat_template(kit, [{"role": "user", "content": "Hello there"}])
            want = "".join(r.text for r in me.create_generator(kit, prompt, max_tokens=8, temp=0))
            me.unload(kit)
            assert answers[model].status_code == 200
            assert answers[model].json()["model"] == model
            assert answers[model].json()["choices"][0]["message"]["content"] == want
        assert answers["lab/delta"].status_code == 200  # the GGUF of alpha's weights, found in LM Studio's layout
        assert (
            answers["lab/delta"].json()["choices"][0]["message"]["content"]
            == answers["alpha"].json()["choices"][0]["message"]["content"]
        )
        entry = host.entries["lab/delta"]
        before = dict(vars(entry))
        one = httpx.get(f"{url}/v1/models/lab/delta", headers=AUTH).json()
        assert one["state"] == "loaded" and one["mlx_engine"]["memory_bytes"] > 0
        assert vars(entry) == before  # a listing reads the entry, never writes it
        assert state(url, "gamma") == "not_loaded"
        missing = httpx.get(f"{url}/v1/models/nope", headers=AUTH)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert chat(url, "nope").status_code == 404
        assert httpx.get(f"{url}/v1/models").status_code == 401


def test_unloaded_model_loads_while_another_streams(host_dir):
    loader = GatedLoader()
    host = make_host(host_dir, loader=loader)
    with serve(create_app(host, api_key=KEY)) as url:
        assert chat(url, "alpha").status_code == 200
        stream = Streamer(url, "alpha")
        wait_until(lambda: stream.chunks > 0)
        loader.gate.clear()  # beta's load waits here until the test has seen alpha go on
        answer = {}
        other = threading.Thread(target=lambda: answer.update(r=chat(url, "beta")), daemon=True)
        other.start()
        wait_until(lambda: state(url, "beta") == "loading")
        seen = stream.chunks
        wait_until(lambda: stream.chunks > seen + 5)  # alpha's stream goes on while beta loads
        assert state(url, "beta") == "loading"
        loader.gate.set()
        other.join(120)
        assert answer["r"].status_code == 200
        assert not stream.done.is_set()  # still streaming: the load never stopped it
        stream.close()


def test_concurrent_first_requests_load_once(host_dir):
    loader = GatedLoader()
    host = make_host(host_dir, loader=loader)
    with serve(create_app(host, api_key=KEY)) as url:
        loader.gate.clear()
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(chat(url, "gamma")), daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: host.entries["gamma"].active == 4)  # all four wait on the one load
        assert state(url, "gamma") == "loading"
        loader.gate.set()
        for t in threads:
            t.join(120)
        assert [a.status_code for a in answers] == [200] * 4
        assert loader.calls == ["gamma"]
        samples = scrape(url)
        assert metric(samples, "mlx_engine_model_loads_total", model="gamma", result="ok") == 1


def test_load_wait_is_bounded_with_retry_after(host_dir):
    loader = GatedLoader()
    host = make_host(host_dir, loader=loader, load_wait_s=0.2)
    with serve(create_app(host, api_key=KEY)) as url:
        loader.gate.clear()
        r = chat(url, "alpha")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert r.headers["Retry-After"]
        loader.gate.set()
        wait_until(lambda: state(url, "alpha") == "loaded")
        assert chat(url, "alpha").status_code == 200
        assert loader.calls == ["alpha"]  # the timed-out request did not abandon or repeat the load


@pytest.mark.slow
def test_failing_load_fails_only_its_requests(tmp_path, llama_path):
    (tmp_path / "alpha").symlink_to(llama_path, target_is_directory=True)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    host = make_host(tmp_path)
    with serve(create_app(host, api_key=KEY)) as url:
        stream = Streamer(url, "alpha", max_tokens=400)
        wait_until(lambda: stream.chunks > 0)
        for _ in range(2):  # each request gets the loader's error; the failure is not remembered
            r = chat(url, "broken")
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["code"] == "model_load_failed" and "config.json" in err["message"]
            assert str(tmp_path) not in err["message"]  # the server's folders are not the client's business
            assert state(url, "broken") == "not_loaded"
        last_error = httpx.get(f"{url}/v1/models/broken", headers=AUTH).json()["mlx_engine"]["last_error"]
        assert "config.json" in last_error and str(tmp_path) not in last_error
        stream.done.wait(120)
        assert stream.status == 200 and stream.chunks > 0
        assert chat(url, "alpha").status_code == 200
        (broken / "config.json").unlink()
        make_model(broken, "llama", hidden=32, layers=1, seed=7, tokenizer_from=llama_path)
        assert chat(url, "broken").status_code == 200  # fixed on disk: the next request loads it
        samples = scrape(url)
        assert metric(samples, "mlx_engine_model_loads_total", model="broken", result="failed") == 2
        assert metric(samples, "mlx_engine_model_loads_total", model="broken", result="ok") == 1


# -- unloading -----------------------------------------------------------------------------
@pytest.mark.slow
def test_ttl_unloads_an_idle_model(host_dir):
    host = make_host(host_dir)  # the host's TTL is an hour; the request sets a short one
    with serve(create_app(host, api_key=KEY)) as url:
        assert chat(url, "alpha", ttl=0.3).status_code == 200
        assert chat(url, "beta").status_code == 200
        assert httpx.get(f"{url}/v1/models/alpha", headers=AUTH).json()["mlx_engine"]["ttl"] == 0.3
        wait_until(lambda: state(url, "alpha") == "not_loaded")
        assert state(url, "beta") == "loaded"
        assert metric(scrape(url), "mlx_engine_model_unloads_total", model="alpha", reason="ttl") == 1
        assert chat(url, "alpha").status_code == 200  # and loads again on demand


@pytest.mark.slow
def test_ttl_never_unloads_a_streaming_model(host_dir):
    host = make_host(host_dir, ttl=0.2)
    with serve(create_app(host, api_key=KEY)) as url:
        stream = Streamer(url, "alpha", max_tokens=4000)
        wait_until(lambda: stream.chunks > 0)
        seen = stream.chunks
        wait_until(lambda: stream.chunks > seen + 200)  # many TTLs' worth of steps
        assert state(url, "alpha") == "loaded"
        stream.close()
        wait_until(lambda: state(url, "alpha") == "not_loaded")  # idle once it ended


@pytest.mark.slow
def test_lru_eviction_within_a_budget_never_evicts_a_busy_model(host_dir, llama_path, qwen_path):
    sizes = []
    for path in (llama_path, qwen_path):
        kit = me.load_model(path, max_parallel=2)
        sizes.append(me.memory_in_use(kit))
        me.unload(kit)
    host = make_host(host_dir, memory_bytes=int(1.5 * max(sizes)))
    with serve(create_app(host, api_key=KEY)) as url:
        assert chat(url, "alpha").status_code == 200
        assert chat(url, "beta").status_code == 200  # alpha, idle, makes room
        assert (state(url, "alpha"), state(url, "beta")) == ("not_loaded", "loaded")
        stream = Streamer(url, "beta")
        wait_until(lambda: stream.chunks > 0)
        refused = chat(url, "alpha")  # the only model that could make room is busy
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_room"
        assert refused.headers["Retry-After"]
        assert state(url, "beta") == "loaded" and not stream.done.is_set()
        stream.close()
        wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == 0)
        assert chat(url, "alpha").status_code == 200
        assert (state(url, "alpha"), state(url, "beta")) == ("loaded", "not_loaded")
        samples = scrape(url)
        assert metric(samples, "mlx_engine_model_unloads_total", reason="evicted") == 2
        assert metric(samples, "mlx_engine_memory_budget_bytes") == int(1.5 * max(sizes))


@pytest.mark.slow
def test_max_loaded_counts_models(host_dir):
    host = make_host(host_dir, max_loaded=1)
    with serve(create_app(host, api_key=KEY)) as url:
        for model in ("alpha", "gamma", "beta"):
            assert chat(url, model).status_code == 200
            loaded = httpx.get(f"{url}/v1/mlx_engine/models", headers=AUTH).json()["data"]
            assert [m["id"] for m in loaded] == [model]


# -- management over HTTP --------------------------------------------------------------------
@pytest.mark.slow
def test_load_and_unload_over_http(host_dir):
    host = make_host(host_dir)
    with serve(create_app(host, api_key=KEY)) as url:
        post = lambda path, body: httpx.post(f"{url}/v1/mlx_engine/models/{path}", json=body, headers=AUTH)  # noqa: E731
        assert post("load", {"model": "alpha"}).status_code == 200
        loaded = post("load", {"model": "alpha", "max_parallel": 1, "context": 256, "compute_dtype": "float32"})
        info = loaded.json()
        assert loaded.status_code == 200 and info["state"] == "loaded"
        assert info["mlx_engine"]["max_parallel"] == 1 and info["mlx_engine"]["ttl"] is None  # explicit: no TTL
        assert host.entries["alpha"].service.kit.cache_options.max_kv_size == 256
        bad = post("load", {"model": "alpha", "max_parallel": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_parallel"
        assert post("load", {"model": "nope"}).status_code == 404
        report = httpx.get(f"{url}/v1/mlx_engine/models", headers=AUTH).json()
        assert [m["id"] for m in report["data"]] == ["alpha"]
        assert report["memory_bytes"] == report["data"][0]["mlx_engine"]["memory_bytes"] > 0
        stream = Streamer(url, "alpha")
        wait_until(lambda: stream.chunks > 0)
        busy = post("unload", {"model": "alpha"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "busy"
        stream.close()
        wait_until(lambda: httpx.get(f"{url}/health").json()["running"] == 0)
        gone = post("unload", {"model": "alpha"})
        assert gone.status_code == 200 and gone.json()["state"] == "not_loaded"
        assert httpx.post(f"{url}/v1/mlx_engine/models/unload", json={"model": "alpha"}).status_code == 401
        assert chat(url, "beta").status_code == 200  # loaded on demand with the server's options
        again = post("load", {"model": "beta", "ttl": 100})  # the same options but the TTL: no reload
        assert again.status_code == 200 and again.json()["mlx_engine"]["ttl"] == 100
        assert metric(scrape(url), "mlx_engine_model_loads_total", model="beta") == 1


def test_unload_writes_the_prompt_cache_disk_tier(host_dir, tmp_path):
    cache_dir = tmp_path / "pcache"
    host = ModelHost(
        models_dirs=[host_dir], catalog=False, defaults=LoadOptions(max_parallel=2, prompt_cache_dir=str(cache_dir))
    )
    with serve(create_app(host, api_key=KEY)) as url:
        assert chat(url, "alpha", text="remember this long enough prompt " * 8).status_code == 200
        assert not list(cache_dir.rglob("*.safetensors"))
        r = httpx.post(f"{url}/v1/mlx_engine/models/unload", json={"model": "alpha"}, headers=AUTH)
        assert r.status_code == 200
        assert list(cache_dir.rglob("*.safetensors"))  # written at unload, as at shutdown


def test_kits_of_an_embedding_host_are_served_and_never_unloaded(llama_path, qwen_path):
    kits = {"a": me.load_model(llama_path), "b": me.load_model(qwen_path)}
    try:
        with serve(create_app(kits, api_key=KEY)) as url:
            assert chat(url, "a").status_code == 200 and chat(url, "b").status_code == 200
            listed = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
            assert [(m["id"], m["state"]) for m in listed] == [("a", "loaded"), ("b", "loaded")]
            r = httpx.post(f"{url}/v1/mlx_engine/models/unload", json={"model": "a"}, headers=AUTH)
            assert r.status_code == 409 and r.json()["error"]["code"] == "not_managed"
        assert all(k.model is not None for k in kits.values())  # still the host's after the app stopped
    finally:
        for k in kits.values():
            me.unload(k)


# -- metrics --------------------------------------------------------------------------------
@pytest.mark.slow
def test_metrics_equal_the_requests_own_statistics(host_dir):
    host = make_host(host_dir)
    with serve(create_app(host, api_key=KEY)) as url:
        usages = {"alpha": [], "beta": []}
        repeat = "one two three four five six seven eight nine ten " * 6
        for model, extra in (
            ("alpha", {}),
            ("alpha", {"n": 2, "temperature": 0.8, "seed": 1}),
            ("alpha", {"mlx_engine": {"decoding": "prompt_lookup"}, "text": repeat}),
            ("alpha", {"mlx_engine": {"decoding": "prompt_lookup"}, "text": repeat}),  # its cached prefix is reused
            ("beta", {"max_tokens": 5}),
        ):
            text = extra.pop("text", "Hello there")
            r = chat(url, model, text=text, **{"max_tokens": 24, **extra})
            assert r.status_code == 200
            usages[model].append(r.json()["usage"])
        assert chat(url, "nope").status_code == 404
        assert httpx.get(f"{url}/metrics").status_code == 401
        samples = scrape(url)

        def stats(usage):  # every choice's engine statistics
            ext = usage["mlx_engine"]
            return ext.get("choices", [ext])

        route = "/v1/chat/completions"
        assert metric(samples, "mlx_engine_requests_total", endpoint=route, model="alpha", status="200") == 4
        assert metric(samples, "mlx_engine_requests_total", endpoint=route, model="beta", status="200") == 1
        assert metric(samples, "mlx_engine_requests_total", endpoint=route, model="", status="404") == 1
        for model, usage in usages.items():
            gens = [s for u in usage for s in stats(u)]
            assert metric(samples, "mlx_engine_prompt_tokens_total", model=model) == sum(
                u["prompt_tokens"] for u in usage
            )
            assert metric(samples, "mlx_engine_generated_tokens_total", model=model) == sum(
                u["completion_tokens"] for u in usage
            )
            cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
            assert metric(samples, "mlx_engine_prompt_cache_reused_tokens_total", model=model) == cached
            assert metric(samples, "mlx_engine_prompt_cache_hits_total", model=model) == sum(
                1 for u in usage if u["prompt_tokens_details"]["cached_tokens"]
            )
            assert metric(samples, "mlx_engine_time_to_first_token_seconds_count", model=model) == len(gens)
            assert metric(samples, "mlx_engine_time_to_first_token_seconds_sum", model=model) == pytest.approx(
                sum(s["time_to_first_token"] for s in gens), abs=1e-3 * len(gens)
            )
            itl = metric(samples, "mlx_engine_inter_token_latency_seconds_count", model=model)
            assert 0 < itl < sum(s["generated_tokens"] for s in gens)  # one gap fewer than tokens per generation
            assert metric(samples, "mlx_engine_generations_total", model=model) == len(gens)
            for mode in {s["decoding_mode"] for s in gens}:
                assert metric(samples, "mlx_engine_decoding_mode_total", model=model, mode=mode) == sum(
                    1 for s in gens if s["decoding_mode"] == mode
                )
        lookup = [s for u in usages["alpha"] for s in stats(u) if s["decoding_mode"] == "prompt_lookup"]
        assert sum(s["drafted_tokens"] for s in lookup) > 0  # the repeated text was drafted
        for name, key in (("drafted", "drafted_tokens"), ("accepted", "accepted_tokens")):
            got = metric(samples, f"mlx_engine_speculation_{name}_tokens_total", model="alpha", mode="prompt_lookup")
            assert got == sum(s[key] for s in lookup)
        first = metric(
            samples,
            "mlx_engine_speculation_acceptance_by_position_count",
            model="alpha",
            mode="prompt_lookup",
            position="0",
        )
        assert first == sum(1 for s in lookup if s["drafted_tokens"])
        loaded = {m["id"]: m for m in httpx.get(f"{url}/v1/mlx_engine/models", headers=AUTH).json()["data"]}
        for model in ("alpha", "beta"):
            assert metric(samples, "mlx_engine_model_loads_total", model=model, result="ok") == 1
            assert metric(samples, "mlx_engine_model_load_seconds_count", model=model) == 1
            assert metric(samples, "mlx_engine_model_state", model=model, state="loaded") == 1
            assert metric(samples, "mlx_engine_rows", model=model) == 2
            assert metric(samples, "mlx_engine_busy_rows", model=model) == 0
            assert metric(samples, "mlx_engine_queue_depth", model=model) == 0
            assert metric(samples, "mlx_engine_model_memory_bytes", model=model) == pytest.approx(
                loaded[model]["mlx_engine"]["memory_bytes"], rel=0.05
            )
        assert metric(samples, "mlx_engine_model_state", model="gamma", state="not_loaded") == 1


def test_metrics_see_a_running_stream(host_dir):
    host = make_host(host_dir)
    with serve(create_app(host, api_key=KEY)) as url:
        stream = Streamer(url, "alpha")
        wait_until(lambda: stream.chunks > 0)
        samples = scrape(url)
        assert metric(samples, "mlx_engine_busy_rows", model="alpha") == 1
        stream.close()
        wait_until(lambda: metric(scrape(url), "mlx_engine_busy_rows", model="alpha") == 0)


def test_metrics_can_be_turned_off(llama_path):
    kit = me.load_model(llama_path)
    try:
        with serve(create_app(kit, metrics=False)) as url:
            assert httpx.get(f"{url}/metrics").status_code == 404
            assert json.loads(httpx.get(f"{url}/health").text)["status"] == "ok"
    finally:
        me.unload(kit)


def test_load_with_a_draft_model(tmp_path, llama_path, draft_path):
    (tmp_path / "alpha").symlink_to(llama_path, target_is_directory=True)
    (tmp_path / "drafty").symlink_to(draft_path, target_is_directory=True)
    host = make_host(tmp_path)
    with serve(create_app(host, api_key=KEY, models_dir=tmp_path)) as url:
        post = lambda body: httpx.post(f"{url}/v1/mlx_engine/models/load", json=body, headers=AUTH)  # noqa: E731
        plain = post({"model": "alpha"}).json()["mlx_engine"]
        assert plain["draft"] is None
        outside = post({"model": "alpha", "draft": str(llama_path.parent.parent)})
        assert outside.status_code == 403 and outside.json()["error"]["param"] == "draft"
        drafted = post({"model": "alpha", "draft": "drafty"})
        assert drafted.status_code == 200, drafted.text
        info = drafted.json()["mlx_engine"]
        assert info["draft"] == "drafty" and info["memory_bytes"] > plain["memory_bytes"]
        r = chat(url, "alpha", mlx_engine={"decoding": "draft"})
        assert r.status_code == 200 and r.json()["usage"]["mlx_engine"]["decoding_mode"] == "draft_model"


def test_a_kit_added_by_id_replaces_the_same_model_found_in_the_folder(host_dir, llama_path):
    host = make_host(host_dir)
    create_app(host, api_key=KEY)  # attaches the host
    kit = me.load_model(llama_path)
    try:
        host.add_kit("main", kit, managed=True)
        assert "alpha" not in host.entries  # alpha is the same folder: served once, as "main"
        host.rescan()
        assert "alpha" not in host.entries and host.entries["main"].state == "loaded"
    finally:
        me.unload(kit)


@pytest.mark.slow
def test_command_line_without_model_serves_the_folder(host_dir, tmp_path):
    """``python -m mlx_engine.server --models-dir DIR`` (no --model): models by name,
    TTL unloads, metrics, and the prompt cache's disk tier written at unload."""
    port = free_port()
    cache = tmp_path / "pcache"
    argv = ["--models-dir", str(host_dir), "--no-catalog", "--port", str(port), "--ttl", "0.5"]
    argv += ["--prompt-cache-dir", str(cache), "--api-key", KEY, "--log-level", "warning"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_engine.server", *argv],
        cwd=Path(__file__).resolve().parents[1],
        env=dict(os.environ),
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(lambda: up() or proc.poll() is not None, timeout=120)
        assert proc.poll() is None
        assert httpx.get(f"{url}/health").json()["model"] is None
        listed = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
        assert sorted(m["id"] for m in listed) == ["alpha", "beta", "gamma", "lab/delta"]
        assert chat(url, "alpha", text="a prompt the cache keeps " * 8).status_code == 200
        wait_until(lambda: state(url, "alpha") == "not_loaded")  # --ttl
        assert list(cache.rglob("*.safetensors"))  # written when the TTL unloaded it
        assert chat(url, "beta").status_code == 200
        samples = scrape(url)
        assert metric(samples, "mlx_engine_model_unloads_total", model="alpha", reason="ttl") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_memory_is_back_after_load_and_unload_cycles(host_dir):
    host = make_host(host_dir)
    with serve(create_app(host, api_key=KEY)) as url:

        def cycle():
            assert chat(url, "alpha").status_code == 200
            r = httpx.post(f"{url}/v1/mlx_engine/models/unload", json={"model": "alpha"}, headers=AUTH)
            assert r.status_code == 200

        cycle()  # first-use allocations (if any) happen here, not between the measurements
        before = settled_active_memory()
        gc.disable()  # what an unload frees must not wait for Python's own collections
        try:
            for _ in range(5):
                cycle()
            # Every unload freed its arrays when it returned: a kit kept by any of the
            # five would add its weights (about 100 MB). Not equality: active memory is
            # process-wide, and in a pytest-xdist worker a kit of another file's tests
            # still alive may finish work meanwhile (-1,448 B seen once, likely the
            # session's SmolLM2 kit measuring costs in the background, which conftest
            # now stops).
            assert mx.get_active_memory() <= before
        finally:
            gc.enable()


# -- hostile folders and requests (issue 56) --------------------------------------------------
def test_dangling_links_in_models_dir_are_skipped_with_a_log_line(tmp_path, llama_path, caplog):
    """A dangling link (a download cleaned up) at either level, or inside a model
    folder, is skipped with one log line; the rest are listed, unknown models are
    404s on every API, and nothing says the folder's absolute path."""
    (tmp_path / "alpha").symlink_to(llama_path, target_is_directory=True)
    (tmp_path / "gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model-Q4.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "config.json").write_text("{}")
    (tmp_path / "shards" / "model.safetensors").symlink_to(tmp_path / "nowhere.safetensors")
    with caplog.at_level("WARNING", logger="mlx_engine.server.hosting.discovery"):
        assert [m.id for m in scan_models_dir(tmp_path)] == ["alpha"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "'gone.gguf' skipped" in logged and "'half' skipped" in logged and "'shards' skipped" in logged
    host = make_host(tmp_path)  # what start-up builds: no traceback
    with serve(create_app(host, api_key=KEY)) as url:
        later = tmp_path / "later"  # a link that goes dangling while the server runs
        later.mkdir()
        (later / "w.gguf").symlink_to(tmp_path / "soon-gone.gguf")
        listed = httpx.get(f"{url}/v1/models", headers=AUTH)
        assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["alpha"]
        answers = [
            chat(url, "unknown"),
            httpx.post(f"{url}/v1/responses", json={"model": "unknown", "input": "hi"}, headers=AUTH),
            httpx.post(
                f"{url}/v1/messages",
                json={"model": "unknown", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                headers=AUTH,
            ),
        ]
        for r in answers:
            assert r.status_code == 404 and str(tmp_path) not in r.text


def test_start_up_survives_a_dangling_link(tmp_path):
    from mlx_engine.server.__main__ import _host, parse_args

    (tmp_path / "gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "m.gguf").symlink_to(tmp_path / "nowhere.gguf")
    host = _host(parse_args(["--models-dir", str(tmp_path), "--no-catalog"]))
    assert host.entries == {}


def test_a_model_larger_than_the_whole_budget_is_a_client_error(host_dir):
    """Not 503 ``no_room`` with Retry-After forever (529 on Messages, which Claude
    Code retries): a 400 naming the model's size and the budget, nothing loaded."""
    host = make_host(host_dir, memory_bytes=1000)
    with serve(create_app(host, api_key=KEY)) as url:
        size = host.entries["alpha"].model.size_bytes
        r = chat(url, "alpha")
        assert r.status_code == 400 and "retry-after" not in r.headers
        err = r.json()["error"]
        assert err["code"] == "model_too_large" and err["param"] == "model"
        assert f"{size} bytes" in err["message"] and "1000 bytes" in err["message"]
        m = httpx.post(
            f"{url}/v1/messages",
            json={"model": "alpha", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            headers=AUTH,
        )
        assert m.status_code == 400 and m.json()["error"]["type"] == "invalid_request_error"
        load = httpx.post(f"{url}/v1/mlx_engine/models/load", json={"model": "alpha"}, headers=AUTH)
        assert load.status_code == 400 and load.json()["error"]["code"] == "model_too_large"
        assert state(url, "alpha") == "not_loaded"


def test_a_bad_draft_in_a_load_request_unloads_nothing(tmp_path, llama_path, qwen_path, foreign_tokenizer_path):
    """``POST /v1/mlx_engine/models/load`` with a draft that cannot serve the
    model: 400 naming ``draft`` before the serving model is unloaded (it stays
    loaded with its options); ``"draft": ""`` is not the models folder."""
    (tmp_path / "alpha").symlink_to(llama_path, target_is_directory=True)
    (tmp_path / "beta").symlink_to(qwen_path, target_is_directory=True)
    (tmp_path / "foreign").symlink_to(foreign_tokenizer_path, target_is_directory=True)
    host = make_host(tmp_path)
    with serve(create_app(host, api_key=KEY, models_dir=tmp_path)) as url:
        post = lambda body: httpx.post(f"{url}/v1/mlx_engine/models/load", json=body, headers=AUTH)  # noqa: E731
        assert post({"model": "alpha", "draft": None}).status_code == 200
        for draft in ("foreign", "", ".", str(tmp_path)):
            r = post({"model": "alpha", "draft": draft, "max_parallel": 1})
            assert r.status_code == 400, (draft, r.text)
            assert r.json()["error"]["param"] == "draft" and str(tmp_path) not in r.json()["error"]["message"]
            assert state(url, "alpha") == "loaded"
        assert r.json()["error"]["message"]
        r = post({"model": "alpha", "draft": "foreign"})
        assert r.json()["error"]["code"] == "incompatible_draft_model" and "'foreign'" in r.json()["error"]["message"]
        assert chat(url, "alpha").status_code == 200
        # A model not loaded yet: the draft's refusal is still the request's 400, not a 500.
        r = post({"model": "beta", "draft": "foreign"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "incompatible_draft_model"
        assert state(url, "beta") == "not_loaded"


def test_the_model_given_at_start_is_listed_first(host_dir, llama_path):
    """``--model FILE.gguf`` with a folder (or the catalog) found first: the given
    model heads ``GET /v1/models``, so a client taking the first lists talks to it."""
    host = make_host(host_dir)
    app = create_app(host, api_key=KEY)
    kit = me.load_model(host_dir / "gamma.gguf")
    try:
        host.add_kit("given", kit, managed=True)
        with serve(app) as url:
            ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
        assert ids[0] == "given" and "gamma" not in ids and set(ids[1:]) == {"alpha", "beta", "lab/delta"}
    finally:
        me.unload(kit)


def test_a_gguf_without_a_chat_template_falls_back_to_chatml(tmp_path, llama_path, caplog):
    """A base model's GGUF (no ``tokenizer.chat_template``) answers chat, Responses
    and Messages requests with ChatML, as llama.cpp's server does, with a warning
    in the log and in its listing; ``--chat-template FILE`` replaces a template."""
    make_gguf(llama_path, tmp_path / "base.gguf", drop=("tokenizer.chat_template",))
    host = make_host(tmp_path)
    with serve(create_app(host, api_key=KEY)) as url, caplog.at_level("WARNING"):
        assert chat(url, "base").status_code == 200
        r = httpx.post(
            f"{url}/v1/messages",
            json={"model": "base", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
        listed = httpx.get(f"{url}/v1/models/base", headers=AUTH).json()["mlx_engine"]["chat_template"]
    assert listed.startswith("ChatML (fallback")
    assert any("has no chat template" in rec.getMessage() for rec in caplog.records)


def test_chat_template_option_replaces_the_models_own(tmp_path, llama_path):
    from mlx_engine.server.__main__ import _load, parse_args

    make_gguf(llama_path, tmp_path / "base.gguf", drop=("tokenizer.chat_template",))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    args = parse_args(["--model", str(tmp_path / "base.gguf"), "--chat-template", str(template)])
    kit = _load(args)
    try:
        want = me.tokenize(kit, "[user] hi\n", add_special_tokens=False)
        assert me.apply_chat_template(kit, [{"role": "user", "content": "hi"}]) == want
    finally:
        me.unload(kit)
    with pytest.raises(SystemExit) as caught:
        parse_args(["--model", str(tmp_path / "base.gguf"), "--chat-template", str(tmp_path / "missing.jinja")])
    assert caught.value.code == 2


def test_unknown_model_names_rescan_the_folders_at_most_once_a_second(tmp_path, monkeypatch):
    from mlx_engine.server.hosting import host as host_module

    scans = []
    real = host_module.scan_models_dir
    monkeypatch.setattr(host_module, "scan_models_dir", lambda *a: scans.append(1) or real(*a))

    def unknown_names(host) -> int:
        scans.clear()
        for i in range(20):
            with pytest.raises(Exception, match="is not known here"):
                host.lookup(f"unknown-{i}")
        return len(scans)

    assert make_host(tmp_path).limits.rescan_interval_s == 1.0  # the default: at most once a second
    assert unknown_names(make_host(tmp_path, rescan_interval_s=0.0)) == 20  # unthrottled, each name walked the folder
    # within the interval of the last scan (the start's): none
    assert unknown_names(make_host(tmp_path, rescan_interval_s=3600.0)) == 0


def test_model_entry_moves_only_by_the_transitions_table():
    """The host's state moves are the table's; any other is a StateError, and the
    state shows as its plain value."""
    from mlx_engine.server.hosting.model_state import TRANSITIONS, ModelEntry, ModelState, StateError

    assert set(TRANSITIONS) == set(ModelState)
    for old, allowed in TRANSITIONS.items():
        for new in ModelState:
            entry = ModelEntry(KnownModel("m", "/m", "directory"), LoadOptions())
            entry.__dict__["state"] = old  # placed, not moved: the start of this check
            if new in allowed:
                entry.state = new
                assert entry.state is new and str(entry.state) == new.value
            else:
                with pytest.raises(StateError):
                    entry.state = new
                assert entry.state is old
