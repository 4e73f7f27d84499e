"""POST /v1/chat/completions (OpenAI's chat API; `model` is the base model or one of the caller's adapters)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.platform.api.deps import CompletionsDep, ModelCallDep
from loraplex.platform.errors import invalid_request
from loraplex.platform.openai_responses import ChatCompletion
from loraplex.platform.openai_schemas import ChatCompletionRequest

router = APIRouter(tags=["chat"])


@router.post("/chat/completions", response_model=ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "A chat.completion, or with stream: true chat.completion.chunk "
                                             "events ending with `data: [DONE]`"}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request, completions: CompletionsDep,
                                 call: ModelCallDep):
    messages = [m.as_template_message() for m in body.messages]

    def encode() -> list[list[int]]:
        try:
            return [completions.engine.encode_chat(messages)]
        except Exception as e:  # the model's chat template refuses this conversation
            raise invalid_request(f"messages cannot be rendered with the model's chat template: {e}",
                                  param="messages") from None

    c = await completions.prepare(call.gate.caller, call.target, "chat", body, num_prompts=1, encode=encode)
    return await completions.serve(request, call.gate, c)
