"""POST /v1/chat/completions (OpenAI's chat API; `model` is the base model or one of the caller's adapters)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.platform import completion
from loraplex.platform.api.deps import GatewayDep, TenantQuota
from loraplex.platform.errors import invalid_request
from loraplex.platform.openai_responses import ChatCompletion
from loraplex.platform.openai_schemas import ChatCompletionRequest

router = APIRouter(tags=["chat"])


@router.post("/chat/completions", response_model=ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "A chat.completion, or with stream: true chat.completion.chunk "
                                             "events ending with `data: [DONE]`"}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, gw: GatewayDep, gate: TenantQuota):
    messages = [m.as_template_message() for m in body.messages]

    def encode() -> list[list[int]]:
        try:
            return [gw.engine.encode_chat(messages)]
        except Exception as e:  # the model's chat template refuses this conversation
            raise invalid_request(f"messages cannot be rendered with the model's chat template: {e}",
                                  param="messages") from None

    c = await completion.prepare(gw, gate.caller, "chat", body, num_prompts=1, encode=encode)
    return await completion.serve(request, gw, gate, c)
