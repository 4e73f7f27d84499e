"""`sample`'s finiteness test and greedy choice, against the exact definitions they shortcut."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.request import Request
from loraplex.engine.sampler import sample
from loraplex.engine.sampling_params import SamplingParams


def greedy(n: int) -> list[Request]:
    return [Request([1], SamplingParams(temperature=0)) for _ in range(n)]


def test_greedy_is_the_first_maximal_index_as_argmax_gives():
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    x[2, 10] = x[2, 500] = x[2].max() + 1  # a tie: the first index wins
    x[5] = 0.0  # a row of ties
    assert sample(x, greedy(8)) == x.argmax(dim=-1).tolist()
    assert sample(x, greedy(8))[2] == 10 and sample(x, greedy(8))[5] == 0


def test_a_finite_row_whose_sum_overflows_is_sampled_and_nan_or_inf_rows_are_refused():
    x = torch.zeros(3, 100)
    x[1, 7] = x[1, 9] = 3e38  # finite, but the row's sum is inf: the cheap test fires, the exact one clears it
    assert sample(x, greedy(3)) == [0, 7, 0]
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 3] = bad
        with pytest.raises(ValueError, match=r"non-finite logits \(NaN or Inf\) in 1 of 3 row\(s\)"):
            sample(y, greedy(3))
