"""``POST /v1/embeddings`` (docs/server.md, "Embeddings"): all-MiniLM-L6-v2 served
by the model host beside a chat model, through raw HTTP, the official ``openai``
client and LangChain's ``OpenAIEmbeddings``; every ``input`` shape, both
encodings, ``dimensions``, bad input as 400s naming the field."""

import mlx_engine as me
from mlx_engine.loading import catalog
from mlx_engine.server import create_app
from mlx_engine.server.hosting.host import ModelHost

import base64
import json
import socket
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from helpers import serve
from langchain_openai import OpenAIEmbeddings
from test_embeddings import requires_minilm

pytestmark = requires_minilm

REFS = json.loads((Path(__file__).parents[1] / "fixtures" / "embeddings" / "minilm_refs.json").read_text())
SENTENCES = REFS["sentences"][:6]
REF_VECTORS = np.array(REFS["vectors"][:6])


@pytest.fixture(scope="module")
def server(tmp_path_factory, llama_path):
    """A host that knows two folders, MiniLM and a tiny chat model, and loads them on demand."""
    served = tmp_path_factory.mktemp("served")
    (served / "minilm").symlink_to(catalog.lookup("all-minilm-l6-v2"))
    (served / "chat").symlink_to(llama_path)
    with serve(create_app(ModelHost(models_dirs=[served], catalog=False))) as url:
        yield url


def post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)


def vectors_of(answer: dict) -> np.ndarray:
    assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
    assert all(d["object"] == "embedding" for d in answer["data"])
    return np.array([d["embedding"] for d in answer["data"]])


def assert_reference(vectors: np.ndarray, refs: np.ndarray = REF_VECTORS) -> None:
    cos = (vectors * refs).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(refs, axis=1)
    assert cos.min() >= 0.999, cos


def test_every_input_shape(server):
    many = post(server, model="minilm", input=SENTENCES)
    assert many.status_code == 200, many.text
    body = many.json()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert_reference(vectors_of(body))
    tokens = [min(n, 256) for n in REFS["untruncated_tokens"][:6]]
    assert body["usage"] == {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
    one = post(server, model="minilm", input=SENTENCES[1]).json()
    assert_reference(vectors_of(one), REF_VECTORS[1:2])
    assert one["usage"]["prompt_tokens"] == tokens[1]
    ids = [101, 7592, 2088, 102]  # "[CLS] hello world [SEP]" in MiniLM's vocabulary
    by_ids = vectors_of(post(server, model="minilm", input=ids).json())
    by_lists = vectors_of(post(server, model="minilm", input=[ids, ids[:3]]).json())
    assert by_ids.shape == (1, 384) and by_lists.shape == (2, 384)
    assert np.abs(by_ids[0] - by_lists[0]).max() < 1e-6
    assert_reference(by_ids, REF_VECTORS[0:1])  # SENTENCES[0] is "Hello world"


def test_base64_decodes_to_the_float_vectors(server):
    floats = vectors_of(post(server, model="minilm", input=SENTENCES[:2]).json())
    answer = post(server, model="minilm", input=SENTENCES[:2], encoding_format="base64").json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in answer["data"]])
    assert np.array_equal(decoded, floats.astype(np.float32))


def test_the_official_client(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    result = client.embeddings.create(model="minilm", input=SENTENCES)  # asks for base64 and decodes it
    assert_reference(np.array([d.embedding for d in result.data]))
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    floats = client.embeddings.create(model="minilm", input=SENTENCES[0], encoding_format="float")
    assert_reference(np.array([floats.data[0].embedding]), REF_VECTORS[:1])
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="minilm", input="x", dimensions=64)
    assert info.value.body["param"] == "dimensions"


@pytest.fixture
def loopback_only(monkeypatch):
    """Any connection other than to this machine's loopback fails the test."""
    real = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        assert host in ("127.0.0.1", "::1", "localhost"), f"a connection to {address!r} left the machine"
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def test_langchain_openai_embeddings(server, loopback_only):
    # check_embedding_ctx_length=False: LangChain sends the texts, not tiktoken's ids of them
    # (OpenAI's tokenizer, whose files tiktoken would download, and whose ids mean nothing to MiniLM).
    emb = OpenAIEmbeddings(
        base_url=f"{server}/v1", api_key="none", model="minilm", check_embedding_ctx_length=False, max_retries=0
    )
    assert_reference(np.array(emb.embed_documents(SENTENCES)))
    assert_reference(np.array([emb.embed_query(SENTENCES[2])]), REF_VECTORS[2:3])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": None}, "input"),
        ({"input": {"text": "x"}}, "input"),
        ({"input": ["ok", 5]}, "input.1"),
        ({"input": ["ok", [1, 2]]}, "input"),
        ({"input": [[1, 2], []]}, "input.1"),
        ({"input": [[1, -2]]}, "input.0"),
        ({"input": [[10**9]]}, "input.0"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
        ({"input": "x", "dimensions": "64"}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 100}, "dimensions"),
        ({"model": "chat", "input": "x"}, "model"),
        ({"model": "", "input": "x"}, "model"),
        ({"input": REFS["sentences"][-1]}, "input"),
        ({"input": ["ok", REFS["sentences"][-1]]}, "input.1"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    answer = post(server, **{"model": "minilm", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split(".")[0] in error["message"]


def test_too_long_truncates_when_asked(server):
    long_text = REFS["sentences"][-1]
    answer = post(server, model="minilm", input=long_text, mlx_engine={"truncate": True})
    assert answer.status_code == 200
    assert answer.json()["usage"]["prompt_tokens"] == 256
    assert_reference(vectors_of(answer.json()), np.array(REFS["vectors"][-1:]))
    refused = post(server, model="minilm", input=long_text).json()["error"]
    assert "722 tokens" in refused["message"] and '"truncate": true' in refused["message"]


def test_an_embedding_model_asked_to_chat_is_a_400_naming_model(server):
    chat = httpx.post(
        f"{server}/v1/chat/completions", json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
    assert "embedding model" in chat.json()["error"]["message"]
    messages = httpx.post(
        f"{server}/v1/messages",
        json={"model": "minilm", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    ok = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=120,
    )
    assert ok.status_code == 200  # the chat model beside it still chats


def test_hosted_on_demand_listed_unloaded_and_in_the_metrics(server):
    assert post(server, model="minilm", input="load me").status_code == 200
    models = {m["id"]: m for m in httpx.get(f"{server}/v1/models").json()["data"]}
    assert models["minilm"]["state"] == "loaded" and models["minilm"]["mlx_engine"]["type"] == "embeddings"
    assert models["minilm"]["mlx_engine"]["memory_bytes"] > 80e6  # MiniLM's float32 weights
    assert models["chat"]["mlx_engine"]["type"] == "llm"
    unloaded = httpx.post(f"{server}/v1/mlx_engine/models/unload", json={"model": "minilm"}, timeout=60)
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "not_loaded"
    assert post(server, model="minilm", input="load me again").status_code == 200  # loaded again on demand
    metrics = httpx.get(f"{server}/metrics").text
    assert 'mlx_engine_embedding_inputs_total{model="minilm"}' in metrics
    assert 'mlx_engine_embedding_seconds_count{model="minilm"}' in metrics
    assert 'mlx_engine_requests_total{endpoint="/v1/embeddings",model="minilm",status="200"}' in metrics


def test_dimensions_on_a_matryoshka_model(llama_path):
    kit = me.load_embedding_model(llama_path, pooling="mean", normalize=True, matryoshka=True)
    try:
        with serve(create_app({"mrl": kit})) as url:
            full = vectors_of(post(url, model="mrl", input=["Hello world!", "def add(a, b):"]).json())
            short = post(url, model="mrl", input=["Hello world!", "def add(a, b):"], dimensions=16).json()
        vectors = vectors_of(short)
        assert vectors.shape == (2, 16)
        expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
        assert np.abs(vectors - expected).max() < 1e-6
    finally:
        me.unload(kit)
