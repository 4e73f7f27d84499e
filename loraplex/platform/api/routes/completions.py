"""POST /v1/completions (OpenAI's legacy text completions: the prompt is sent as is, no chat template)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from loraplex.platform import completion
from loraplex.platform.api.deps import GatewayDep, TenantQuota
from loraplex.platform.errors import invalid_request
from loraplex.platform.openai_schemas import CompletionRequest

router = APIRouter(tags=["completions"])


def _prompts(gw, prompt) -> list[list[int]]:
    """str, [str, ...], [int, ...] or [[int, ...], ...] -> token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    return [gw.engine.encode(p) if isinstance(p, str) else list(p) for p in prompt]


@router.post("/completions")
async def create_completion(body: CompletionRequest, request: Request, gw: GatewayDep, gate: TenantQuota):
    plan = completion.Plan("completion", body, prompts=[])
    await completion.resolve_model(gw, gate.caller.tenant_id, plan)
    completion.check_fan_out(gw, plan, body.num_prompts)
    plan.prompts = await asyncio.to_thread(_prompts, gw, body.prompt)
    if any(not p for p in plan.prompts):
        raise invalid_request("The prompt is empty.", param="prompt")
    return await completion.run(request, gw, gate, plan)
