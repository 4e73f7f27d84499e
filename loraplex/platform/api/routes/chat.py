"""POST /v1/chat/completions (OpenAI's chat API; `model` is the base model or one of the caller's adapters)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from loraplex.platform import completion
from loraplex.platform.api.deps import GatewayDep, TenantQuota
from loraplex.platform.errors import invalid_request
from loraplex.platform.openai_schemas import ChatCompletionRequest

router = APIRouter(tags=["chat"])


@router.post("/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, gw: GatewayDep,
                                 gate: TenantQuota):
    plan = completion.Plan("chat", body, prompts=[])
    await completion.resolve_model(gw, gate.caller.tenant_id, plan)
    completion.check_fan_out(gw, plan, num_prompts=1)
    messages = [m.as_template_message() for m in body.messages]
    try:
        plan.prompts = [await asyncio.to_thread(gw.engine.encode_chat, messages)]
    except Exception as e:  # the model's chat template refuses this conversation
        raise invalid_request(f"messages cannot be rendered with the model's chat template: {e}",
                              param="messages") from None
    return await completion.run(request, gw, gate, plan)
