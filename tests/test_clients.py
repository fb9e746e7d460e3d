"""Real client packages against a real server started with default flags: LangChain (chat and
embeddings), the OpenAI Agents SDK (Chat Completions and Responses models), instructor,
litellm's wire calls, Anthropic's SDK, lm-evaluation-harness's scoring request, and
`tools: []` on every dialect (the terminal shell: tests/test_runtime_deps.py).

The oracles: each client's own parsing (LangChain's AIMessage.tool_calls and pydantic
structured output, the Agents SDK running our tool, Anthropic's Message model), jsonschema for
call arguments, and HF transformers' log-probabilities for lm-eval's scoring. lm-eval itself is
heavy (datasets, evaluate, ...): its `local-completions` request and its `parse_logprobs` are
reproduced from its source (lm_eval/models/openai_completions.py, 0.4.x).

The bundled SmolLM2-135M has no tool-call syntax in its template and does not call tools on its
own: it runs in minisgl's default format, and a conversation that already holds one call of the
tool (a one-shot example, as the prompt shows it) makes it call the tool for the next city.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from pydantic import BaseModel

from tests.server_utils import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 120.0
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "Current weather of a city."
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER},
    }
]


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server  # default flags: no --tool-call-parser


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"sunny in {city}, 21 C"


def test_langchain_bind_tools_with_the_default_tool_choice(server: ServerProcess) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    def llm(**options: Any) -> Any:
        chat = ChatOpenAI(
            base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, **options
        )
        return chat.bind_tools([get_weather])  # tool_choice omitted: OpenAI's "auto"

    history = [
        HumanMessage("What is the weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]),
        HumanMessage("What is the weather in Rome?"),
    ]
    plain = llm(max_tokens=48).invoke(history)
    streamed = llm(max_tokens=48, streaming=True).invoke(history)
    for reply in (plain, streamed):
        assert isinstance(reply, AIMessage) and len(reply.tool_calls) == 1, reply
        call = reply.tool_calls[0]
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER)
    assert streamed.tool_calls[0]["args"] == plain.tool_calls[0]["args"]
    # The call's result goes back as a tool message; the reply to it is text, not a 400.
    result = ToolMessage(get_weather(**plain.tool_calls[0]["args"]), tool_call_id="c2")
    answer = llm(max_tokens=24).invoke([*history, plain, result])
    assert isinstance(answer, AIMessage) and answer.content


def test_langchain_structured_output(server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI

    class City(BaseModel):
        name: str
        country: str

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0)
    city = llm.with_structured_output(City).invoke("Name a city in France.")
    assert isinstance(city, City) and city.name  # pydantic parsed the JSON reply


def test_instructor_response_model(server: ServerProcess) -> None:
    """instructor's default mode (TOOLS): the model is one tool, named in tool_choice."""
    import instructor
    import openai

    class City(BaseModel):
        name: str
        country: str

    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    client = instructor.from_openai(sdk)
    city = client.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Name a city in France."}],
        max_tokens=64,
        temperature=0,
        max_retries=0,  # a reply pydantic rejects fails the test instead of being asked again
    )
    assert isinstance(city, City) and city.name and city.country


def test_litellm_wire_calls(server: ServerProcess) -> None:
    """litellm (44 MB, not in the test extra) through its `openai/` and `hosted_vllm/`
    providers: the bodies below are what litellm 1.110 sent, captured from a run of it (model,
    messages, max_tokens, tools; no tool_choice; `embedding`'s model and input), read back with
    the OpenAI SDK's models."""
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": get_weather("Paris")},
        {"role": "user", "content": "What is the weather in Rome?"},
    ]
    body = {"model": MODEL, "messages": history, "max_tokens": 48, "tools": CHAT_TOOLS}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    message = ChatCompletion.model_validate(reply.json()).choices[0].message
    for call in message.tool_calls or []:
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert message.tool_calls or message.content, message
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    assert Completion.model_validate(reply.json()).choices[0].text is not None
    # litellm.embedding sends no encoding_format: floats come back (its own parsing reads those)
    body = {"model": MODEL, "input": ["The history of Paris", "Embeddings"]}
    reply = httpx.post(server.url + "/v1/embeddings", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    vectors = [item.embedding for item in CreateEmbeddingResponse.model_validate(reply.json()).data]
    assert len(vectors) == 2 and torch.allclose(torch.tensor(vectors).norm(dim=1), torch.ones(2))


def test_langchain_embeddings(server: ServerProcess) -> None:
    """LangChain's OpenAIEmbeddings as its docs configure it for other providers
    (`check_embedding_ctx_length=False`: text on the wire, not OpenAI's tiktoken ids): its
    vectors are the openai SDK's, documents batched and a query alone."""
    import openai
    from langchain_openai import OpenAIEmbeddings

    texts = ["The history of the city of Paris began", "Embeddings", "go go go " * 40]
    embeddings = OpenAIEmbeddings(
        base_url=server.url + "/v1",
        api_key="unused",
        model=MODEL,
        check_embedding_ctx_length=False,
        chunk_size=2,  # two requests
    )
    documents = torch.tensor(embeddings.embed_documents(texts))
    query = torch.tensor(embeddings.embed_query(texts[1]))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    expected = torch.tensor([d.embedding for d in reply.data])
    assert documents.shape == expected.shape
    assert torch.allclose(documents, expected, atol=1e-5)
    assert torch.allclose(query, expected[1], atol=1e-5)


def test_openai_agents_sdk_with_and_without_tools(server: ServerProcess) -> None:
    """Both of the SDK's models. Without tools it sends `tools: []`; with tool_choice
    "required" the first turn must call the tool (the SDK runs it), then the SDK resets
    tool_choice to auto and sends the result back."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload to anyone
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S)
    cities: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """Current weather of a city."""
        cities.append(city)
        return get_weather(city)

    async def run(model_class: Any, tools: list[Any], question: str, **settings: Any) -> Any:
        agent = Agent(
            name="assistant",
            instructions="You are a helpful assistant.",
            tools=tools,
            model=model_class(model=MODEL, openai_client=client),
            model_settings=ModelSettings(max_tokens=128, temperature=0, **settings),
        )
        return await Runner.run(agent, question, max_turns=4)

    async def both_models() -> list[tuple[Any, Any]]:  # one event loop for the one client
        runs = []
        for model_class in (OpenAIChatCompletionsModel, OpenAIResponsesModel):
            alone = await run(model_class, [], "What is the capital of France?")
            weather_question = "What is the weather in Paris?"
            # One call: a tiny model adds calls to a "required" array until max_tokens.
            one_call = {"tool_choice": "required", "parallel_tool_calls": False}
            tooled = await run(model_class, [weather], weather_question, **one_call)
            runs.append((alone, tooled))
        return runs

    for alone, tooled in asyncio.run(both_models()):
        assert isinstance(alone.final_output, str) and alone.final_output
        kinds = [type(item) for item in tooled.new_items]
        assert kinds[:2] == [ToolCallItem, ToolCallOutputItem], kinds
        assert isinstance(tooled.final_output, str) and tooled.final_output
    assert len(cities) >= 2 and all(isinstance(c, str) and c for c in cities)


def test_anthropic_sdk_tools_with_the_default_tool_choice(server: ServerProcess) -> None:
    import anthropic
    from anthropic.types import Message

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=TIMEOUT_S)
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    for i, city in enumerate(("Paris", "Berlin", "Madrid")):
        use = {"type": "tool_use", "id": f"t{i}", "name": "get_weather", "input": {"city": city}}
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": get_weather(city)}
        messages += [
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
            {"role": "assistant", "content": f"It is sunny in {city}."},
            {"role": "user", "content": "And the weather in Rome?"},
        ]
    reply = client.messages.create(model=MODEL, max_tokens=48, tools=tools, messages=messages)
    assert isinstance(reply, Message)
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(calls) == 1, reply
    assert calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER)


def test_an_empty_tool_list_means_no_tools_on_every_dialect(server: ServerProcess) -> None:
    """The Agents SDK sends `tools: []` for an agent without tools: the reply is the one
    without the field."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    routes = {
        "/v1/chat/completions": ({"messages": question, "max_tokens": 12}, _chat_text),
        "/v1/responses": ({"input": question, "max_output_tokens": 12}, _responses_text),
        "/v1/messages": ({"messages": question, "max_tokens": 12}, _messages_text),
    }
    for path, (body, text_of) in routes.items():
        body = {"model": MODEL, "temperature": 0, **body}
        texts = []
        for tools in ({"tools": []}, {}):
            reply = httpx.post(server.url + path, json={**body, **tools}, timeout=TIMEOUT_S)
            assert reply.status_code == 200, (path, reply.text)
            texts.append(text_of(reply.json()))
        assert texts[0] == texts[1] and texts[0], path


def _chat_text(reply: dict[str, Any]) -> str:
    return reply["choices"][0]["message"]["content"]


def _responses_text(reply: dict[str, Any]) -> str:
    return "".join(part["text"] for item in reply["output"] for part in item["content"])


def _messages_text(reply: dict[str, Any]) -> str:
    return "".join(block["text"] for block in reply["content"])


def _lm_eval_parse_logprobs(reply: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs: the last entry (the generated token) is
    dropped."""
    results = []
    for choice, ctxlen in zip(
        sorted(reply["choices"], key=lambda c: c["index"]), ctxlens, strict=True
    ):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(
            lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs, strict=True)
        )
        results.append((sum(token_logprobs), greedy))
    return results


def test_lm_eval_loglikelihoods_match_transformers(
    server: ServerProcess, default_model_dir: Path
) -> None:
    """Every choice scored as lm-eval scores it, against HF transformers on the same checkpoint,
    including choices after which the model's next token is end-of-sequence (whose entry was
    once missing, so lm-eval dropped the answer's last token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The reference: the bundled model converted to fp32 (the server multiplies its blocks)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    turn = "<|im_start|>user\nWhat is the capital of {}?<|im_end|>\n<|im_start|>assistant\n"
    requests = [
        (turn.format(country), answer)
        for country in ("France", "Italy")
        for answer in (f"The capital of {country} is Paris.", f"The capital of {country} is Rome.")
    ]
    requests += [("The sky is", " blue"), ("One, two,", " three")]
    contexts = [tokenizer.encode(c) for c, _ in requests]
    prompts = [ctx + tokenizer.encode(a) for ctx, (_, a) in zip(contexts, requests, strict=True)]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT_S).json()
    ours = _lm_eval_parse_logprobs(reply, [len(c) for c in contexts])
    ends = 0
    for prompt, context, (score, greedy) in zip(prompts, contexts, ours, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        positions = range(len(context), len(prompt))
        want = sum(logprobs[i - 1, prompt[i]].item() for i in positions)
        want_greedy = all(logprobs[i - 1].argmax().item() == prompt[i] for i in positions)
        assert score == pytest.approx(want, abs=2e-3) and greedy == want_greedy, prompt
        ends += int(logprobs[-1].argmax().item() == tokenizer.eos_token_id)
    assert ends >= 2, "no choice is followed by end-of-sequence: the case is not exercised"
    for choice, prompt in zip(
        sorted(reply["choices"], key=lambda c: c["index"]), prompts, strict=True
    ):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    # lm-eval's remote tokenizer probe: /tokenizer_info and /tokenize
    info = httpx.get(server.url + "/tokenizer_info", timeout=TIMEOUT_S).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"]
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": "test", "add_special_tokens": False}
    ).json()["tokens"]
    assert ids == tokenizer.encode("test", add_special_tokens=False)
