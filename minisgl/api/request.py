"""The internal request every dialect's body becomes, and the rules that make it SamplingParams.

A dialect validates its wire shape with a `WireModel` (strict JSON types, valid Unicode, null
means the default, unknown fields ignored). Fields named like SamplingParams' own, or mapped to
one by the dialect's alias table, become `ApiRequest.sampling`; the same table names the
field in a 400 (`max_output_tokens` on the Responses API for a rule on `max_tokens`)."""

import asyncio
import dataclasses
import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Self, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from minisgl.chat import ChatPrompt
from minisgl.chat.jsontext import find_invalid_text
from minisgl.core import KEY_TENANT_PREFIX, Constraint, SamplingParams
from minisgl.limits import InvalidRequestError, ModelLimits, check_request, resolve_max_tokens

JsonObject = dict[str, Any]  # a JSON object: a request body, a reply, an event
SAMPLING_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_T = TypeVar("_T")
# A list validated up to its first bad item: a union tries each of its types, and an error for
# each of a million token ids takes seconds.
FailFastList = Annotated[list[_T], Field(fail_fast=True)]
KEY_TENANT_HASH_CHARS = 12  # an API key's tenant: a hash prefix, never the key itself


def api_key_tenant(headers: Mapping[str, str]) -> str | None:
    """The tenant of a request that names no user: the API key it presents (`x-api-key` or a
    Bearer token, as the server's Gate checks it), as KEY_TENANT_PREFIX and a short hash."""
    key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
    return (
        f"{KEY_TENANT_PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:KEY_TENANT_HASH_CHARS]}"
        if key
        else None
    )


def new_id(prefix: str, sep: str = "-") -> str:
    """`chatcmpl-...`; with sep "_", the Responses and Anthropic shape (`resp_...`, `msg_...`)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def invalid_at(where: str, message: str) -> InvalidRequestError:
    """A broken rule in a part of a field (`messages[2].content[0]`), blamed on the field."""
    return InvalidRequestError(where.partition("[")[0], f"{where}: {message}")


def function_call(call_id: str, name: str, arguments: str) -> JsonObject:
    """A tool call as chat messages carry it (`tool_calls` entries)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(
    tools: list[Any] | None, kind: str, keys: Mapping[str, str], default: str | None = None
) -> list[JsonObject] | None:
    """A dialect's flat tools of type `kind` (`default` where a tool names none) -> chat's
    {"type": "function", "function": {...}}, its fields renamed by `keys` (theirs -> chat's; a
    null one left out, as OpenAI allows). Another type is a 400."""
    chat = []
    for i, tool in enumerate(tools or ()):
        given = tool.get("type", default) if isinstance(tool, Mapping) else None
        if given != kind:
            raise InvalidRequestError("tools", f"tools[{i}]: {given!r} tools are not supported")
        function = {ours: tool[k] for k, ours in keys.items() if tool.get(k) is not None}
        chat.append({"type": "function", "function": function})
    return None if tools is None else chat


def chat_tool_choice(choice: Any, named: str, plain: Mapping[str, str], expected: str) -> Any:
    """`tool_choice` in chat's form: a string as it is, {"type": named, "name"} the named
    function, {"type": t} for t in `plain` that string; anything else a 400 (`expected`)."""
    if not isinstance(choice, Mapping):
        return choice
    if (kind := choice.get("type", "")) in plain:
        return plain[kind]
    if kind == named and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError("tool_choice", f"must be {expected}")


class WireModel(BaseModel):
    """A request body (or part of one) in some dialect's shape."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _check_text_and_nulls(cls, data: Any) -> Any:
        """Text must be valid Unicode; an explicit null for a field is left out, so the field
        takes its default."""
        if (where := find_invalid_text(data)) is not None:
            raise InvalidRequestError(where, "must be valid Unicode text (no lone surrogates)")
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @classmethod
    def validated(cls, data: Any, *loc: str) -> Self:
        """`data` (a JSON body's bytes, or their value) as this model; its errors reported as
        FastAPI reports a body's (under `loc`)."""
        try:
            return cls.model_validate(json.loads(data) if isinstance(data, bytes) else data)
        except ValidationError as exc:
            errors = [{**e, "loc": (*loc, *e["loc"])} for e in exc.errors()]
        except ValueError:  # not JSON
            errors = [{"type": "json_invalid", "loc": ()}]
        raise RequestValidationError(errors)

    @classmethod
    async def from_request(cls, request: Request) -> Self:
        """The request's body as this model, parsed and validated on a thread: for a million
        token ids that takes a second, which the event loop spends on other requests."""
        return await asyncio.to_thread(cls.validated, await request.body())


class SamplingWire(WireModel):
    """What every generation dialect takes: the model, `stream`, and the sampling fields under
    SamplingParams' own names (OpenAI's temperature and top_p, and the extras vLLM and SGLang
    accept everywhere)."""

    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: FailFastList[int] | None = None
    logit_bias: JsonObject | None = None  # token id (as text) -> bias in [-100, 100]
    min_tokens: int | None = None  # no EOS, stop token or stop string before this many
    ignore_eos: bool = False
    priority: int | None = None  # --enable-priority-scheduling: larger goes sooner


class ChatWire(SamplingWire):
    """What every chat dialect takes beside its messages (checked with clear messages in
    minisgl.chat.requests)."""

    tools: list[Any] | None = None
    chat_template_kwargs: JsonObject | None = None


def sampling_of(
    body: BaseModel, aliases: Mapping[str, str], **elsewhere: Any
) -> tuple[JsonObject, dict[str, str]]:
    """(the SamplingParams fields `body` sets, by their names; what each is called on the wire).

    `aliases` maps a wire field to the internal name it stands for (a SamplingParams field, or
    another name the pipeline reports errors on, such as "messages"). A set alias wins over a
    field of the internal name itself (max_completion_tokens over max_tokens). `elsewhere`:
    fields the request gives outside `body` (SGLang's top-level priority), which `body` overrides.
    """
    sent = body.model_fields_set
    sampling = {**elsewhere, **{name: getattr(body, name) for name in SAMPLING_NAMES & sent}}
    wire_names = {}
    for wire_name, name in aliases.items():
        if wire_name in sent or name not in sent:
            wire_names[name] = wire_name
        if wire_name in sent and name in SAMPLING_NAMES:
            sampling[name] = getattr(body, wire_name)
    return sampling, wire_names


@dataclass(frozen=True)
class ApiRequest:
    """What every dialect's request becomes; the pipeline (minisgl.api.pipeline) runs it.

    `prompt`: a conversation, or one or more prompts (text or token ids), each run `n` times.
    `sampling`: SamplingParams fields the client set (or one such mapping per prompt);
    `max_tokens` None or absent means what the context leaves. `wire_names`: internal name ->
    the client's field, for a 400's param."""

    prompt: ChatPrompt | list[str] | list[list[int]]
    sampling: JsonObject | list[JsonObject]
    wire_names: Mapping[str, str]
    n: int = 1
    model: str | None = None
    constraint_fields: JsonObject = field(default_factory=dict)

    def wire(self, name: str) -> str:
        return self.wire_names.get(name, name)

    @property
    def prompt_param(self) -> str:
        return self.wire("messages" if isinstance(self.prompt, ChatPrompt) else "prompt")

    def invalid(self, exc: InvalidRequestError) -> InvalidRequestError:
        """A broken rule (a 400), `param` named as this dialect's clients spell it."""
        return InvalidRequestError(self.wire(exc.param), exc.message)


def choice_params(
    req: ApiRequest,
    prompt_index: int,
    prompt_ids: list[int],
    limits: ModelLimits,
    defaults: JsonObject,
    constraint: Constraint | None,
) -> list[SamplingParams]:
    """One SamplingParams per choice of this prompt, every rule checked (a 400 if one breaks).
    `defaults`: for the fields the request leaves, the model's recommended sampling values and
    the tenant of the API key presented (`user`)."""
    sampling = req.sampling[prompt_index] if isinstance(req.sampling, list) else req.sampling
    # The model's defaults (models.model_config.GENERATION_SAMPLING_KEYS), then the request's.
    fields = {**defaults, **{name: value for name, value in sampling.items() if value is not None}}
    requested = fields.get("max_tokens")
    seed = fields.pop("seed", None)
    try:
        fields["max_tokens"] = resolve_max_tokens(
            requested, len(prompt_ids), limits, req.prompt_param, req.wire("max_tokens")
        )
        if requested is None and "min_tokens" in fields:  # more than explicit max_tokens: a 400
            fields["min_tokens"] = min(fields["min_tokens"], fields["max_tokens"])
        params = [
            SamplingParams(**fields, seed=_choice_seed(seed, j), constraint=constraint)
            for j in range(req.n)
        ]
        check_request(prompt_ids, params[0], limits, req.prompt_param)  # the same for every j
    except InvalidRequestError as exc:
        raise req.invalid(exc) from None
    return params


def _choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: seed + j, wrapped into the 64-bit signed range, so n sequences are
    reproducible yet differ for any valid seed (choice 0's is the seed as sent, checked as such)."""
    if seed is None or j == 0:
        return seed
    return (seed + j + 2**63) % 2**64 - 2**63
