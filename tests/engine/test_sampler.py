"""`sample`'s finiteness test and greedy choice, against the exact definitions they shortcut."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.request import Request
from loraplex.engine.sampler import sample
from loraplex.engine.sampling_params import SamplingParams
from loraplex.kernels import cpu_ext


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


def _first_max_paths() -> list[str]:
    ext = cpu_ext.load()
    if ext is None:
        return []
    return [p for p, ok in (("scalar", True), ("avx2", ext.avx2_available()), ("avx512", ext.avx512_available())) if ok]


@pytest.mark.parametrize("path", _first_max_paths())
def test_first_max_gives_pytorchs_max_index_on_every_path_this_cpu_has(path):
    """The kernel's pick (csrc/first_max_cpu.cpp) against `logits.max(dim=-1).indices` row by row: random rows,
    maxima tied at random places (across the chains, their lanes and the tail), rows of ties, signed zeros,
    -inf (a grammar's mask) and +inf, at vocab sizes around the vector steps; rows of a wider tensor."""
    ext = cpu_ext.load()
    gen = torch.Generator().manual_seed(0)
    for v in (1, 2, 7, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 49152):
        x = torch.randn(40, v, generator=gen)
        for row in range(30):  # 1-4 equal maxima at random places: the first one is the pick
            at = torch.randint(0, v, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)
            x[row, at] = x[row].max() + 1
        x[30] = 0.0
        x[31] = 0.0
        x[31, v // 2:] = -0.0  # +0 and -0 compare equal: the first index
        x[32] = -0.0
        x[32, -1] = 0.0
        x[33] = float("-inf")
        x[34] = float("-inf")
        x[34, -1] = -3.0
        x[35, torch.arange(v) % 3 == 0] = float("-inf")
        x[36, v - 1] = float("inf")
        x[37, 0] = float("inf")
        x[37, -1] = float("inf")
        x[38] = torch.finfo(torch.float32).min
        x[39] = torch.finfo(torch.float32).tiny * torch.rand(v, generator=gen) * x[39].sign()  # subnormals
        want = x.max(dim=-1).indices
        assert torch.equal(ext.first_max(x, path), want), (path, v)
        wide = torch.randn(40, v + 3, generator=gen)
        wide[:, :v] = x
        assert torch.equal(ext.first_max(wide[:, :v], path), want), (path, v)  # rows v + 3 apart


@pytest.mark.parametrize("path", _first_max_paths())
def test_first_max_leaves_a_row_with_nan_to_the_caller(path):
    ext = cpu_ext.load()
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    x[1, 999] = float("nan")  # in the tail
    x[2, 0] = float("nan")  # in the chains' first load
    x[3, 500] = float("nan")
    got = ext.first_max(x, path).tolist()
    assert got[1:] == [-1, -1, -1] and got[0] == int(x[0].argmax())


def test_first_max_refuses_what_it_cannot_read():
    ext = cpu_ext.load()
    if ext is None:
        pytest.skip("no CPU kernels here")
    x = torch.randn(8, 16)
    for bad in (x.t(), x.double(), x[:, :0], x[0], torch._neg_view(x)):  # a neg view's data is not its values
        with pytest.raises(RuntimeError, match="first_max: logits must be a 2-D fp32 CPU tensor with contiguous rows"):
            ext.first_max(bad, "auto")
    with pytest.raises(RuntimeError, match="first_max: no path 'avx1024'"):
        ext.first_max(x, "avx1024")
    if not ext.avx512_available():
        with pytest.raises(RuntimeError, match="first_max: this CPU has no avx512"):
            ext.first_max(x, "avx512")


def test_sample_takes_the_kernels_pick_and_pytorchs_where_it_cannot(monkeypatch):
    """`sampler.first_max` hands fp32 CPU logits to the kernel and uses what it returns; a row the kernel
    leaves (-1: a NaN), bf16 logits and a build without the kernel take PyTorch's max."""
    from types import SimpleNamespace

    from loraplex.engine import sampler

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    calls = []

    def fake(picks):
        def first_max(logits, path="auto"):
            calls.append(logits.dtype)
            return torch.tensor(picks)
        return SimpleNamespace(load=lambda: SimpleNamespace(first_max=first_max))

    monkeypatch.setattr(sampler, "cpu_ext", fake([7, 8, 9]))
    assert sample(x, greedy(3)) == [7, 8, 9] and calls == [torch.float32]  # the kernel's answer, as it is
    monkeypatch.setattr(sampler, "cpu_ext", fake([7, -1, 9]))
    assert sampler.first_max(x) == x.max(dim=-1).indices.tolist()  # one row left: PyTorch's for the batch
    calls.clear()
    assert sampler.first_max(x.bfloat16()) == x.bfloat16().max(dim=-1).indices.tolist() and calls == []
    negated = torch._neg_view(x)  # its data is x's: the kernel would read the wrong values
    assert sampler.first_max(negated) == (-x).max(dim=-1).indices.tolist() and calls == []
    monkeypatch.setattr(sampler, "cpu_ext", SimpleNamespace(load=lambda: None))
    assert sampler.first_max(x) == x.max(dim=-1).indices.tolist()
