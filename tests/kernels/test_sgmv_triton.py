"""Triton SGMV kernels against the dense fp32 truth (natively on a GPU, in the interpreter on a CPU).

Every case pads each slot's weights beyond its rank with NaN, fills unused slots with NaN, and gives
rows without an adapter NaN in x and NaN / -inf / -0.0 in y: any masked load or write that slips
shows up as a NaN or a changed bit. Paged cases (virtual slots of 8 or 16 rank rows, several adapters
per physical slot) also hold NaN in pages no adapter owns and in every adapter's pages beyond its rank.
"""

import pytest
import torch
from lora_cases import (
    DEVICE,
    MAX_RANK,
    NUM_SLOTS,
    assert_matches,
    dense_reference,
    fill_padding,
    make_case,
    paged_layout,
)

from loraplex.kernels import lora_ops
from loraplex.kernels.metadata import build_lora_meta
from loraplex.kernels.triton_sgmv import (
    TILE_TABLE,
    TileConfig,
    add_lora_triton,
    pick_tiles,
    sgmv_expand,
    sgmv_shrink,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (T, popularity, adapters, dtype, H_in, H_out): a sample of the grid, not its full product, so the
# interpreter run stays short. Each T meets several popularities and each popularity several dtypes.
GRID = [
    (1, "distinct", 1, F32, 72, 61),
    (7, "distinct", 7, BF16, 100, 61),
    (7, "identical", 1, F16, 72, 45),
    (16, "distinct", 16, BF16, 72, 61),
    (64, "uniform", 16, BF16, 100, 61),
    (64, "zipf", 8, F16, 72, 61),
    (64, "distinct", 16, F32, 72, 45),
    (64, "skewed", 5, F16, 100, 33),
    (300, "skewed", 4, BF16, 100, 61),
    (300, "zipf", 16, F32, 72, 45),
    (300, "uniform", 2, F16, 100, 33),
    (300, "identical", 1, BF16, 72, 61),
]

# Small blocks force several H_in steps, several rank steps (rank 64 in blocks of 16), several column
# blocks, and split-K (3 does not divide the steps evenly).
ODD_TILES = [
    TileConfig(block_m=1, block_k=32, split_k=2, block_n=16, block_r=16, num_warps=4),
    TileConfig(block_m=16, block_k=32, split_k=3, block_n=32, block_r=16, num_warps=4),
    TileConfig(block_m=32, block_k=16, split_k=1, block_n=16, block_r=32, num_warps=4),
]


def _run(case, tiles=None):
    y_before = case.y.clone()
    out = add_lora_triton(case.y, case.x, case.slices, case.meta, case.offsets, tiles)
    assert out is case.y
    assert_matches(out, case, y_before)


@pytest.mark.parametrize("num_tokens, popularity, num_adapters, dtype, h_in, h_out", GRID)
def test_matches_dense(num_tokens, popularity, num_adapters, dtype, h_in, h_out):
    _run(make_case(num_tokens, popularity, num_adapters, dtype, h_in, [h_out], seed=num_tokens))


# (page, T, popularity, adapters, dtype, H_in, H_outs): paged slot buffers, mixed ranks 4 / 8 / 16 / 64
# packed several to a physical slot (see lora_cases.paged_layout); two slices give an adapter
# different ranks in each.
PAGED_GRID = [
    (8, 1, "distinct", 1, F32, 72, [61]),
    (8, 16, "distinct", 16, BF16, 72, [61]),
    (8, 64, "zipf", 12, F32, 100, [61, 33]),
    (8, 300, "skewed", 6, BF16, 72, [45]),
    (8, 40, "identical", 1, F16, 72, [61]),
    (16, 7, "uniform", 7, F32, 100, [61]),
    (16, 64, "uniform", 16, BF16, 72, [61, 33]),
    (16, 300, "zipf", 16, F32, 72, [45]),
]


@pytest.mark.parametrize("page, num_tokens, popularity, num_adapters, dtype, h_in, h_outs", PAGED_GRID)
def test_paged_matches_dense(page, num_tokens, popularity, num_adapters, dtype, h_in, h_outs):
    case = make_case(num_tokens, popularity, num_adapters, dtype, h_in, h_outs, seed=num_tokens, page=page)
    assert case.slices[0].num_virtual_slots == NUM_SLOTS * MAX_RANK // page
    assert {s for s in case.slot_ids if s >= 0} <= {s for s, _ in paged_layout(page)}
    _run(case)


@pytest.mark.parametrize("tiles", ODD_TILES, ids=lambda t: f"m{t.block_m}k{t.block_k}s{t.split_k}n{t.block_n}")
def test_paged_odd_tiles(tiles):
    _run(make_case(24, "uniform", 10, BF16, 100, [61], seed=12, page=8), tiles)


def test_paged_layout_packs_pages_and_leaves_some_free():
    for page in (8, 16):
        layout = paged_layout(page)
        rows = [(s * page, s * page + cap) for s, cap in layout]  # flat rank rows of each adapter
        assert all(end <= start2 for (_, end), (start2, _) in zip(rows[:-1], rows[1:], strict=True))  # no overlap
        assert all(start // MAX_RANK == (end - 1) // MAX_RANK for start, end in rows)  # one physical slot each
        assert len(layout) > NUM_SLOTS and sum(cap for _, cap in layout) < NUM_SLOTS * MAX_RANK


@pytest.mark.parametrize("tiles", [TILE_TABLE[0][1], TILE_TABLE[1][1]], ids=["m1", "m16"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_adjacent_adapters_in_one_physical_slot(tiles, dtype):
    """Virtual slots 0 and 1 (rank 8 each) share physical slot 0; slot 2 (rank 4, its page's other 4
    rows NaN) and slot 3 (rank 8) share physical slot 1. Each row must get exactly its own adapter,
    with its own scale, computed here from the adapters' own weights rather than the buffers."""
    gen = torch.Generator().manual_seed(13)
    h_in, h_out = 72, 61
    w = lora_ops.LoRAWeights.empty(2, 16, h_in, h_out, dtype, DEVICE, page=8)
    adapters = {0: (8, 0.5), 1: (8, 3.0), 2: (4, 1.5), 3: (8, -2.0)}  # virtual slot -> (rank, scale)
    weights = {}
    for s, (r, scale) in adapters.items():
        a = (torch.randn(r, h_in, generator=gen) / h_in**0.5).to(dtype)
        b = (torch.randn(h_out, r, generator=gen) / r**0.5).to(dtype)
        w.set_slot(s, a, b, scale)
        weights[s] = (a.float(), b.float(), scale)
    fill_padding(w, float("nan"))
    assert torch.isnan(w.A[1, 4:8]).all() and not torch.isnan(w.A[0]).any()
    slot_ids = [0, 1, 1, -1, 0, 2, 3, 1, 0, 3, 2, 2, -1, 0, 1, 3, 3, 0, 1, 2]
    x = torch.randn(len(slot_ids), h_in, generator=gen).to(dtype)
    y = torch.randn(len(slot_ids), h_out, generator=gen).to(dtype)
    y_before = y.clone()
    meta = build_lora_meta(slot_ids, DEVICE)
    out = add_lora_triton(y.to(DEVICE), x.to(DEVICE), [w], meta, [0], tiles).cpu()
    atol, rtol = {F32: (1e-4, 1e-4), BF16: (3e-2, 3e-2)}[dtype]
    for t, s in enumerate(slot_ids):
        if s < 0:
            assert torch.equal(out[t].view(torch.int16), y_before[t].view(torch.int16))
            continue
        a, b, scale = weights[s]
        want = y_before[t].float() + scale * (b @ (a @ x[t].float()))
        torch.testing.assert_close(out[t].float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("tiles", [cfg for _, cfg in TILE_TABLE] + ODD_TILES,
                         ids=lambda t: f"m{t.block_m}k{t.block_k}s{t.split_k}n{t.block_n}r{t.block_r}")
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_every_tile_shape(tiles, dtype):
    _run(make_case(40, "zipf", 6, dtype, 100, [61], seed=1), tiles)


@pytest.mark.parametrize("num_tokens, popularity, dtype", [(64, "uniform", BF16), (9, "distinct", F16)])
def test_fused_qkv_gqa(num_tokens, popularity, dtype):
    """q/k/v of different widths in one launch; one adapter does not target v (rank 0 there)."""
    case = make_case(num_tokens, popularity, 8, dtype, 576, [576, 192, 192], seed=2)
    skipped = next(s for s in case.slot_ids if s >= 0)
    case.slices[2].set_slot(skipped, None, None, 0.0)
    fill_padding(case.slices[2], float("nan"))
    _run(case)


def test_gate_up_any_offsets():
    """Slices placed in y out of order: up first, then gate."""
    case = make_case(20, "uniform", 4, BF16, 72, [97, 97], seed=3)
    case.offsets = [97, 0]
    _run(case)


def test_fp32_output_of_16bit_weights():
    """y may be wider than the weights: the expand adds its fp32 sum and rounds once to y's dtype."""
    case = make_case(20, "zipf", 4, BF16, 72, [61], seed=6)
    case.y = case.y.float()
    y_before = case.y.clone()
    add_lora_triton(case.y, case.x, case.slices, case.meta, case.offsets)
    assert_matches(case.y, case, y_before)


@pytest.mark.parametrize("page", [0, 8])
def test_shrink_writes_each_rank(page):
    """Each row's v holds x @ its adapter's own A rows, with whole slots (page 0) or paged slots."""
    case = make_case(30, "zipf" if not page else "uniform", 5 if not page else 9, F32, 100, [61, 33],
                     seed=4 if not page else 14, page=page)
    v = sgmv_shrink(case.x, case.slices, case.meta)  # [2, T, R]
    assert v.shape == (2, 30, 64) and v.dtype == torch.float32
    for i, w in enumerate(case.slices):
        for t, s in enumerate(case.slot_ids):
            if s >= 0:
                r = w.ranks_list[s]
                want = case.x[t].float().cpu() @ w.a_rows(s, r).float().cpu().T
                torch.testing.assert_close(v[i, t, :r].cpu(), want, atol=1e-5, rtol=1e-5)


def test_no_adapter_rows_only():
    case = make_case(5, "uniform", 2, F16, 72, [61])
    meta = build_lora_meta([-1] * 5, DEVICE)
    y_before = case.y.clone()
    add_lora_triton(case.y, case.x, case.slices, meta, case.offsets)
    assert torch.equal(case.y.view(torch.int16), y_before.view(torch.int16))


def test_forced_backend_dispatches_to_triton(monkeypatch):
    monkeypatch.setattr(lora_ops, "_backend", "triton")
    case = make_case(12, "uniform", 3, F16, 72, [61, 45], seed=5)
    y_before = case.y.clone()
    lora_ops.add_lora(case.y, case.x, case.slices, case.meta)  # default offsets: consecutive
    assert_matches(case.y, case, y_before)


def test_tile_table_is_ordered_and_covers_every_length():
    bounds = [bound for bound, _ in TILE_TABLE]
    assert bounds == sorted(bounds)
    for max_seg_len in (1, 2, 16, 17, 4096, 10**9):
        meta = build_lora_meta([0] * min(max_seg_len, 3))
        meta.max_seg_len = max_seg_len
        assert pick_tiles(meta).block_m >= 1


def _bad(case, what):
    """Break one thing about a valid case; returns the call that must raise."""
    x, y, slices, meta, offsets = case.x, case.y, list(case.slices), case.meta, case.offsets
    w = slices[0]
    if what == "x dtype":
        x = x.double()
    elif what == "weight dtype":
        slices[0] = lora_ops.LoRAWeights(w.A.half(), w.B.half(), w.ranks, w.scales, w.ranks_list, w.scales_list)
    elif what == "A not contiguous":
        a = w.A.transpose(1, 2).contiguous().transpose(1, 2)
        slices[0] = lora_ops.LoRAWeights(a, w.B, w.ranks, w.scales, w.ranks_list, w.scales_list)
    elif what == "H_in":
        x = x[:, :-1]
    elif what == "rows":
        x, y = x[:-1], y[:-1]
    elif what == "offsets":
        offsets = [1]
    elif what == "slot":
        meta = build_lora_meta([NUM_SLOTS] + case.slot_ids[1:], DEVICE)
    elif what == "rank":
        slices[0] = lora_ops.LoRAWeights(w.A[:, :8].contiguous(), w.B[:, :, :8].contiguous(), w.ranks,
                                         w.scales, w.ranks_list, w.scales_list)
    elif what == "ranks dtype":
        slices[0] = lora_ops.LoRAWeights(w.A, w.B, w.ranks.long(), w.scales, w.ranks_list, w.scales_list)
    elif what == "y dtype":
        y = y.double()
    return lambda: add_lora_triton(y, x, slices, meta, offsets)


@pytest.mark.parametrize("what", ["x dtype", "weight dtype", "A not contiguous", "H_in", "rows", "offsets",
                                  "slot", "rank", "ranks dtype", "y dtype"])
def test_launcher_rejects(what):
    case = make_case(6, "distinct", 6, F32, 72, [61], padding="zero")
    with pytest.raises(ValueError):
        _bad(case, what)()


def _bad_paged(what):
    """A valid paged call (page 8, rank 8 at virtual slots 0 and 1), broken in one way."""
    w = lora_ops.LoRAWeights.empty(2, 16, 72, 61, F32, DEVICE, page=8)
    for s in (0, 1):
        w.set_slot(s, torch.randn(8, 72), torch.randn(61, 8), 1.0)
    slot_ids = [0, 1, -1]
    if what == "virtual slot":
        slot_ids = [0, 4, -1]  # V = 4
    elif what == "rank past its physical slot":
        w.ranks_list[1], w.ranks[1] = 16, 16  # rows 8..23 of a 16-row slot
    elif what == "ranks per physical slot":
        w = lora_ops.LoRAWeights(w.A, w.B, w.ranks[:2].clone(), w.scales[:2].clone(), w.ranks_list[:2],
                                 w.scales_list[:2], page=8)
    elif what == "page":
        w.page = 5
    x, y = torch.randn(3, 72, device=DEVICE), torch.randn(3, 61, device=DEVICE)
    return lambda: add_lora_triton(y, x, [w], build_lora_meta(slot_ids, DEVICE), [0])


def test_paged_valid_call_runs():
    _bad_paged("nothing")()


@pytest.mark.parametrize("what", ["virtual slot", "rank past its physical slot", "ranks per physical slot", "page"])
def test_launcher_rejects_paged(what):
    with pytest.raises(ValueError):
        _bad_paged(what)()


def test_expand_rejects_bad_v():
    case = make_case(6, "distinct", 6, F32, 72, [61], padding="zero")
    v = sgmv_shrink(case.x, case.slices, case.meta)
    for bad in (v.half(), v[:, :-1], v[..., :4]):
        with pytest.raises(ValueError):
            sgmv_expand(case.y, bad, case.slices, case.meta, case.offsets)


def test_wrong_mode_is_explained(monkeypatch):
    from loraplex.kernels import triton_sgmv

    monkeypatch.setattr(triton_sgmv, "INTERPRETED", DEVICE != "cpu")
    case = make_case(4, "distinct", 4, F32, 72, [61], padding="zero")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        add_lora_triton(case.y, case.x, case.slices, case.meta, case.offsets)


def test_reference_truth_is_plain():
    """The truth itself: one row, one adapter, by hand."""
    case = make_case(1, "distinct", 1, F32, 72, [61], padding="zero")
    s, w = case.slot_ids[0], case.slices[0]
    r = w.ranks_list[s]
    want = case.y[0].cpu() + w.scales_list[s] * (w.B[s, :, :r] @ (w.A[s, :r] @ case.x[0])).cpu()
    torch.testing.assert_close(dense_reference(case)[0], want)


def test_reference_truth_reads_paged_rows():
    """The truth of a paged case, by hand: the adapter's rows via LoRAWeights.a_rows / b_cols."""
    case = make_case(4, "distinct", 4, F32, 72, [61], padding="zero", page=8)
    ref, w = dense_reference(case), case.slices[0]
    for t, s in enumerate(case.slot_ids):
        if s >= 0:
            r = w.ranks_list[s]
            want = case.y[t].cpu() + w.scales_list[s] * (w.b_cols(s, r) @ (w.a_rows(s, r) @ case.x[t])).cpu()
            torch.testing.assert_close(ref[t], want)
