"""SamplingParams refuses every out-of-range value with a ParamError naming the field and the range."""

from __future__ import annotations

import math

import pytest

from loraplex.engine.sampling_params import MAX_NUM_STOP, MAX_STOP_LENGTH, ParamError, SamplingParams


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens", "max_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-0.1), "temperature", "temperature must be a number in [0, 2], got -0.1"),
    (dict(temperature=2.01), "temperature", "temperature must be a number in [0, 2], got 2.01"),
    (dict(temperature=math.nan), "temperature", "temperature must be a number in [0, 2], got nan"),
    (dict(temperature=math.inf), "temperature", "temperature must be a number in [0, 2], got inf"),
    (dict(top_p=0), "top_p", "top_p must be a number in (0, 1], got 0"),
    (dict(top_p=math.nan), "top_p", "top_p must be a number in (0, 1], got nan"),
    (dict(top_k=-2), "top_k", "top_k must be -1 or 0 (off) or an integer in [1, vocab_size], got -2"),
    (dict(top_k=2.0), "top_k", "top_k must be -1 or 0 (off) or an integer in [1, vocab_size], got 2.0"),
    (dict(seed=2**63), "seed", "seed must be an integer in [-2**63, 2**63 - 1], got 9223372036854775808"),
    (dict(seed=-(2**63) - 1), "seed", "seed must be an integer in [-2**63, 2**63 - 1], got -9223372036854775809"),
    (dict(stop=["x"] * (MAX_NUM_STOP + 1)), "stop", f"stop takes at most {MAX_NUM_STOP} strings, got 17"),
    (dict(stop="x" * (MAX_STOP_LENGTH + 1)), "stop",
     f"each stop string has at most {MAX_STOP_LENGTH} characters, got one of 257"),
    (dict(stop=[1]), "stop", "stop must be a string or a list of strings, got list"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "stop_token_ids must be token ids in [0, vocab_size), got -1"),
    (dict(stop_token_ids=list(range(65))), "stop_token_ids", "stop_token_ids takes at most 64 ids, got 65"),
])
def test_out_of_range_values_name_the_field(kwargs, param, message):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value) == message
    assert isinstance(e.value, ValueError)  # callers that catch ValueError keep working


def test_vocab_checks_need_the_model():
    p = SamplingParams(top_k=10**30, stop_token_ids=[5])  # fine until the vocabulary is known
    with pytest.raises(ParamError, match=r"top_k must be -1 or 0 \(off\) or an integer in \[1, 100\], got 10{30}"):
        p.check_vocab(100)
    SamplingParams(top_k=100, stop_token_ids=[99]).check_vocab(100)
    with pytest.raises(ParamError, match=r"stop_token_ids must be token ids in \[0, 100\), got 100"):
        SamplingParams(stop_token_ids=[100]).check_vocab(100)


def test_limits_themselves_are_accepted():
    p = SamplingParams(max_tokens=1, temperature=2, top_p=1, top_k=-1, seed=-(2**63), stop=["", "a" * 256] + ["b"] * 14)
    assert p.temperature == 2.0 and p.stop == ["a" * 256] + ["b"] * 14 and p.is_greedy is False
    assert SamplingParams(seed=2**63 - 1, stop="x").stop == ["x"]
    assert SamplingParams(top_k=0).top_k == -1  # vLLM: 0 also keeps every token
