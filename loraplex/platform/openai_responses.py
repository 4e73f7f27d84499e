"""Response bodies of the OpenAI-compatible endpoints (pydantic), in OpenAI's wire format, so that the
OpenAPI page (`/docs`) shows the real shapes. Non-streamed answers are built through these; stream
chunks are plain dicts of the same fields (`completion.stream`), built per token where a model would
cost a validation each.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV cache blocks came from the prefix cache


class UsageBody(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


ChoiceT = TypeVar("ChoiceT")


class _Completion(BaseModel, Generic[ChoiceT]):
    """What a chat and a text completion share; `object` and the choices' shape tell them apart."""

    id: str
    object: str
    created: int  # Unix seconds
    model: str
    system_fingerprint: None = None
    choices: list[ChoiceT]
    usage: UsageBody


class ChatCompletion(_Completion[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class TextLogprobs(BaseModel):
    """The legacy completions shape: per token its text, logprob, top alternatives and offset in the text
    (logprob and alternatives null for an echoed prompt's first token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: str | None


class TextCompletion(_Completion[TextChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    """The base model (`parent` None, owned by loraplex) or one of the caller's adapters."""

    id: str
    object: Literal["model"] = "model"
    created: int  # Unix seconds
    owned_by: str
    parent: str | None
    root: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AdapterCard(BaseModel):
    """A tenant's adapter: its rank `r`, the projections it targets, its tensors' size (bytes) and content
    digest (sha256 of its files); times are UTC ISO 8601."""

    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    parent: str
    rank: int
    target_modules: list[str]
    num_bytes: int
    digest: str
    created_at: str
    last_used_at: str | None


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class Deleted(BaseModel):
    id: int | str
    object: str
    deleted: Literal[True] = True
