"""The server uses only mlx_engine's public names, and one JSON depth limit."""

import mlx_engine as me
from mlx_engine.server.core.params import check_nesting
from mlx_engine.server.core.schemas import ChatCompletionRequest
from mlx_engine.server.web.errors import APIError

import ast
from pathlib import Path

import pytest

SERVER = Path(me.__file__).parent / "server"


def nested_to(depth: int) -> dict:
    """A tool schema whose JSON nests exactly ``depth`` levels (as ``json_depth`` counts)."""
    value: dict = {}
    while me.json_depth(value) < depth:
        value = {"x": value}
    assert me.json_depth(value) == depth
    return value


def tools_request(parameters: dict) -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool])


def test_server_imports_only_public_engine_names():
    """No module under server/ imports an engine module other than mlx_engine itself."""
    for path in SERVER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mlx_engine"):
                ok = node.module == "mlx_engine" or node.module.startswith("mlx_engine.server")
                assert ok, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name == "mlx_engine" or not alias.name.startswith("mlx_engine."), path.name


def test_discovery_and_depth_names_are_public(tmp_path):
    for name in (
        "memory_in_use",
        "MAX_JSON_DEPTH",
        "json_depth",
        "is_gguf",
        "find_gguf",
        "is_embedding_model",
        "physical_memory",
    ):
        assert name in me.__all__
    assert me.json_depth('{"a": [1]}') == me.json_depth({"a": [1]}) > me.json_depth({"a": 1})
    assert not me.is_gguf(tmp_path) and me.find_gguf(tmp_path) is None
    assert not me.is_embedding_model(tmp_path) and me.physical_memory() > 0


def test_server_nesting_limit_is_the_sdks():
    """Tool schemas nested to the SDK's limit pass the server; one level more is a 400 naming the field."""
    check_nesting(tools_request(nested_to(me.MAX_JSON_DEPTH)))
    with pytest.raises(APIError) as err:
        check_nesting(tools_request(nested_to(me.MAX_JSON_DEPTH + 1)))
    assert err.value.status == 400 and err.value.param == "tools.0.function.parameters"
    assert str(me.MAX_JSON_DEPTH) in err.value.message
