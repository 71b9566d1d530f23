"""LangChain's ChatOpenAI against tandem, unchanged: bind_tools and with_structured_output."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")  # the dev extra installs it


class Forecast(BaseModel):
    """A weather forecast."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=9)


class get_weather(BaseModel):  # noqa: N801 (a tool's name, as the model sees it)
    """Current weather in a city, for a number of days."""

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=5)  # bounded: the tiny random model writes digits forever


@pytest.fixture
def chat(server, model_name):
    return langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="x", model=model_name, temperature=0,
        max_tokens=120, max_retries=0,
    )  # fmt: skip


def test_bind_tools_returns_tool_calls_langchain_can_run(chat):
    msg = chat.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Rome?"
    )
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["args"]["city"] in ("Paris", "Rome", "Oslo") and isinstance(
        call["args"]["days"], int
    )
    named = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather?")
    assert [c["name"] for c in named.tool_calls] == ["get_weather"]


def test_with_structured_output_returns_the_pydantic_model(chat):
    for method in ("json_schema", "function_calling"):
        result = chat.with_structured_output(Forecast, method=method).invoke("Forecast for Paris?")
        assert isinstance(result, Forecast)
