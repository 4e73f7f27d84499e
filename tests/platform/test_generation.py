"""`Generation`: the engine's step outputs as the gateway keeps them, streamed or not."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.request import RequestOutput
from loraplex.platform.engine_client import Generation


def out(rid: str, tokens: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=[1], token_ids=tokens, text="x" * len(tokens),
                         finish_reason="length" if finished else None, adapter=None, delta_text="x",
                         delta_token_ids=tokens[-1:])


def test_a_stream_gets_each_steps_deltas_in_one_batch_and_a_json_call_keeps_none():
    async def main():
        streamed = Generation(None, ["c-0", "c-1"], stream=True)
        plain = Generation(None, ["c-0", "c-1"], stream=False)
        steps = [[out("c-0", [5], False), out("c-1", [6], False)],
                 [out("c-0", [5, 7], True), out("c-1", [6, 8], True)]]
        for gen in (streamed, plain):
            for step in steps:
                gen._feed(step)
        batches = [[(i, o.token_ids) for i, o in batch] async for batch in streamed.batches()]
        assert batches == [[(0, [5]), (1, [6]), (0, [5, 7]), (1, [6, 8])]]  # all arrived before it read
        for gen in (streamed, plain):
            await asyncio.wait_for(gen.wait(), 1)
            assert gen.is_done and [c.token_ids for c in gen.choices] == [[5, 7], [6, 8]]
            assert [c.finish_reason for c in gen.choices] == ["length", "length"]
        assert plain._pending == []  # each delta carries the output so far: none is kept for a JSON answer
        with pytest.raises(RuntimeError, match="keeps no deltas"):
            async for _ in plain.batches():
                pass

    asyncio.run(main())
