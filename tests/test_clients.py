"""Client libraries whose defaults force tool calls, against the server on the
default model: instructor's TOOLS mode and LangChain's ``bind_tools`` with a
named ``tool_choice``. Both need an answer that ends on exactly one call with
``finish_reason: "tool_calls"`` (docs/server.md, tool calls); before that a
forced call repeated until ``max_tokens`` and both failed."""

import mlx_engine as me  # noqa: F401  (first: loads OpenBLAS before mlx.core)
from mlx_engine.server import create_app

import instructor
import openai
import pytest
from helpers import requires_default_model, serve
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

pytestmark = [requires_default_model, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(smollm):
    with serve(create_app(smollm, model_id=MODEL)) as url:
        yield url


class City(BaseModel):
    name: str
    country: str


def test_instructor_tools_mode_extracts_a_model(server):
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0), mode=instructor.Mode.TOOLS
    )
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Paris is the capital of France. Extract the city."}],
        max_retries=0,
        max_tokens=200,
        temperature=0.0,
    )
    assert city.name == "Paris" and city.country == "France"


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_langchain_forced_bind_tools_gives_one_call(server, choice):
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="none", model=MODEL, temperature=0.0, max_tokens=200)
    msg = llm.bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert msg.tool_calls[0]["args"]["city"] == "Paris"
    assert msg.response_metadata["finish_reason"] == "tool_calls"
