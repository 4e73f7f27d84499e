"""What crosses from an engine replica to the ingress (`WireOutput`) and what the ingress rebuilds from it
(`client._Accumulated`): the same outputs the engine gave, without copies that grow with the output."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the scale-out path is Ray Serve's: pip install -e '.[test,ray]'")

from loraplex.engine.request import RequestOutput  # noqa: E402
from loraplex.engine.sampler import TokenLogprobs  # noqa: E402
from loraplex.platform.scaleout.client import _Accumulated  # noqa: E402
from loraplex.platform.scaleout.replica import WireOutput  # noqa: E402


def engine_outputs() -> list[RequestOutput]:
    """Three steps of one request that asked for output and prompt log-probabilities."""
    scores = [None, TokenLogprobs(8, -0.5)]
    lps = [TokenLogprobs(t, -1.0 * t) for t in (11, 12, 13)]
    outs = []
    for k in range(3):
        done = k == 2
        outs.append(RequestOutput("r", [7, 8], [11, 12, 13][:k + 1], "abc"[:k + 1], "length" if done else None, None,
                                  delta_text="abc"[k], delta_token_ids=[11 + k], logprobs=lps[:k + 1],
                                  delta_logprobs=[lps[k]], prompt_logprobs=scores))
    return outs


def test_the_ingress_rebuilds_the_engines_outputs_and_prompt_scores_cross_once():
    outs = engine_outputs()
    wire = [WireOutput.of(o, first=k == 0) for k, o in enumerate(outs)]
    assert [w.prompt_logprobs is not None for w in wire] == [True, False, False]
    acc = _Accumulated([7, 8])
    rebuilt = [acc.output(w, None) for w in wire]
    assert rebuilt[-1] == outs[-1]
    assert rebuilt[0].delta_logprobs == outs[0].delta_logprobs and rebuilt[0].prompt_logprobs == outs[0].prompt_logprobs
    assert acc.logprobs is not rebuilt[-1].logprobs  # the last output holds a copy, not the list still growing
    assert acc.ended("r", None, "lost").logprobs == outs[-1].logprobs
