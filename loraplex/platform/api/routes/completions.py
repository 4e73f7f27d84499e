"""POST /v1/completions (OpenAI's legacy text completions: the prompt is sent as is, no chat template)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.platform.api.deps import CompletionsDep, ModelCallDep
from loraplex.platform.openai_responses import TextCompletion
from loraplex.platform.openai_schemas import CompletionRequest

router = APIRouter(tags=["completions"])


@router.post("/completions", response_model=TextCompletion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "A text_completion, or with stream: true text_completion events "
                                             "ending with `data: [DONE]`"}})
async def create_completion(body: CompletionRequest, request: Request, completions: CompletionsDep, call: ModelCallDep):
    prompt = body.prompt
    # str, [str, ...], [int, ...] or [[int, ...], ...] -> token id lists
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt

    def encode() -> list[list[int]]:
        return [completions.engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    c = await completions.prepare(call.gate.caller, call.target, "completion", body, body.num_prompts, encode)
    return await completions.serve(request, call.gate, c)
