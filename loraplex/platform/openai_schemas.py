"""Request bodies of the OpenAI-compatible endpoints (pydantic). Responses are built as plain dicts in
`completion.py`, in OpenAI's wire format.

Every sampling field is checked here by the same function `SamplingParams` uses (`engine/sampling_params`),
so each refusal is a 400 whose `param` names the field and whose message gives the allowed range. Limits
that are settings (`n`, prompts and sequences per call) and checks that need the model (context, and
`top_k` and `stop_token_ids` against the vocabulary) are applied by `completion.py` before anything is
queued. NaN and Infinity (which Python's JSON parser reads) are refused in every number: by the range
checks, which say the range, and as not supported in the fields that are.
Fields loraplex cannot honour are refused by name, never silently ignored; unknown fields are ignored,
as OpenAI's API does with fields it does not know.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from loraplex.engine.sampling_params import (
    ParamError,
    check_logprobs,
    check_max_tokens,
    check_priority,
    check_seed,
    check_stop,
    check_temperature,
    check_text,
    check_top_p,
)
from loraplex.platform.errors import UnsupportedParameter
from loraplex.platform.response_format import parse_response_format

# Fields of OpenAI's API that loraplex refuses unless they hold their neutral value (what leaving them
# out means), with that value.
UNSUPPORTED_SAMPLING = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}

# Optional fields whose range `SamplingParams` checks; None (left out) takes the engine's default.
_RANGE_CHECKS = {
    "max_tokens": check_max_tokens,
    "temperature": check_temperature,
    "top_p": check_top_p,
    "seed": check_seed,
    "priority": check_priority,
}
UNSUPPORTED_CHAT = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none", "audio": None,
                    "prediction": None, "modalities": ["text"], "reasoning_effort": "none", "verbosity": None,
                    "web_search_options": None}
SERVICE_TIERS = (None, "auto", "default")  # what loraplex serves every call at; "flex", "priority"... are refused
UNSUPPORTED_COMPLETION = {"suffix": ""}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for `logprobs` of /v1/completions


def _is_neutral(value, neutral) -> bool:
    return value is None or value == neutral or (isinstance(neutral, (dict, list)) and not value)


def _refuse_unsupported(info: ValidationInfo, value, table: dict):
    if not _is_neutral(value, table[info.field_name]):
        raise UnsupportedParameter(f"`{info.field_name}` is not supported by loraplex")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        return check_text(v, "messages")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list | None = None
    function_call: Any = None

    @field_validator("content", "name")
    @classmethod
    def _content(cls, v):
        return check_text(v, "messages") if isinstance(v, str) else v

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list) and not v:  # OpenAI: an array of at least one part
            raise ValueError("content is an empty list: send a string or at least one text part")
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise UnsupportedParameter(f"content parts of type {kind!r} are not supported by loraplex: the "
                                           "model takes text only (parts of type \"text\")")
        return v

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v):
        if v in ("tool", "function"):
            raise UnsupportedParameter(f"{v} messages are not supported by loraplex (it has no tool calling)")
        return v

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _tool_calls(cls, v, info: ValidationInfo):
        if v:
            raise UnsupportedParameter(f"assistant messages with `{info.field_name}` are not supported by loraplex "
                                       "(it has no tool calling)")
        return v

    @model_validator(mode="after")
    def _needs_content(self):
        if self.content is None and self.role != "assistant":  # OpenAI: only an assistant turn may omit it
            raise ValueError(f"a {self.role} message needs `content`")
        return self

    def as_template_message(self) -> dict:
        if isinstance(self.content, list):  # text parts one per line, as vLLM's chat_utils joins them
            text = "\n".join(p.text for p in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = Field(None, description="vLLM extension: -1 or 0 keep every token, else 1..vocab size")
    ignore_eos: StrictBool | None = Field(None, description="vLLM extension: EOS does not stop, generate max_tokens "
                                          "(null: false, as every optional field's null is its default)")
    n: StrictInt | None = Field(1, description="choices per prompt, 1..LORAPLEX_MAX_N (null: 1)")
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, description="vLLM extension: token ids that end a choice")
    seed: StrictInt | None = None
    priority: StrictInt | None = Field(None, description="vLLM extension: lower runs first (null: the tenant's "
                                                         "default priority, a quota field)")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    response_format: dict | None = Field(None, description="text, json_object or json_schema (response_format.py)")
    service_tier: Any = None

    max_tokens_may_be_0: ClassVar[bool] = False

    @field_validator(*_RANGE_CHECKS)
    @classmethod
    def _in_range(cls, v, info: ValidationInfo):
        if v == 0 and info.field_name == "max_tokens" and cls.max_tokens_may_be_0:
            return v  # completions with echo score the prompt alone; without echo, `completion.check_lengths`
        return v if v is None else _RANGE_CHECKS[info.field_name](v)

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        return 1 if v is None else v

    @field_validator("stream")
    @classmethod
    def _stream(cls, v):
        return bool(v)

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, v):
        if v not in SERVICE_TIERS:
            raise UnsupportedParameter(f"service_tier {v!r} is not supported by loraplex: every call runs at "
                                       "\"default\" (a tenant's urgency is loraplex's `priority` field)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        check_stop(v)
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @field_validator(*UNSUPPORTED_SAMPLING)
    @classmethod
    def _unsupported_sampling(cls, v, info: ValidationInfo):
        return _refuse_unsupported(info, v, UNSUPPORTED_SAMPLING)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        parse_response_format(v)
        return v

    @property
    def json_schema(self) -> dict | None:
        """`SamplingParams.json_schema`: the JSON Schema `response_format` asks for, None for text."""
        return parse_response_format(self.response_format)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    modalities: list | None = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v):
        return v if v is None else check_max_tokens(v, "max_completion_tokens")

    @field_validator(*UNSUPPORTED_CHAT)
    @classmethod
    def _unsupported_chat(cls, v, info: ValidationInfo):
        return _refuse_unsupported(info, v, UNSUPPORTED_CHAT)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        return check_logprobs(v, "top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: None (none asked), else the top log-probabilities per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """`echo: true` returns each prompt before its completion, and with `logprobs` every prompt token's
    log-probability (the first's null) and top alternatives before the completion's (OpenAI's legacy
    completions and vLLM; lm-eval-harness scores a continuation this way). `max_tokens: 0` with echo
    scores the prompt alone."""

    max_tokens_may_be_0: ClassVar[bool] = True

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("the prompt is empty")
        for text in [v] if isinstance(v, str) else v:
            if isinstance(text, str):
                check_text(text, "prompt")
        return v

    @field_validator(*UNSUPPORTED_COMPLETION)
    @classmethod
    def _unsupported_completion(cls, v, info: ValidationInfo):
        return _refuse_unsupported(info, v, UNSUPPORTED_COMPLETION)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        return check_logprobs(v, "logprobs", MAX_COMPLETION_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v not in (None, 1, info.data.get("n")):
            raise UnsupportedParameter("`best_of` other than 1 or n is not supported by loraplex")
        return v

    @property
    def num_prompts(self) -> int:
        """Prompts in `prompt` (one string or token id list, or a list of them), known before tokenizing."""
        p = self.prompt
        return 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)
