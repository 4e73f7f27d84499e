"""Request bodies of the OpenAI-compatible endpoints (pydantic). Responses are built as plain dicts in
`completion.py`, in OpenAI's wire format. Fields loraplex cannot honour are refused by name, never
silently ignored; unknown fields are ignored, as OpenAI's API does with fields it does not know."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, description="loraplex extension: -1 keeps every token")
    ignore_eos: bool = Field(False, description="vLLM extension: EOS does not stop, generate max_tokens")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v != -1 and v < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by loraplex (send 0 or leave it out)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by loraplex")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.logprobs:
            raise ValueError("logprobs is not supported by loraplex")
        if self.tools:
            raise ValueError("tools are not supported by loraplex")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported by loraplex")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("the prompt is empty")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by loraplex")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by loraplex")
        return self
