"""PyTorch reference and CPU paths (segmented, packed, bgmv), segment metadata and dispatch, against the dense truth."""

import pytest
import torch
from lora_cases import DEVICE, POPULARITIES, assert_matches, make_case

from loraplex.kernels import cpu, cpu_bgmv, cpu_ext, cpu_packed, lora_ops
from loraplex.kernels.cpu_bgmv import add_lora_bgmv, add_lora_dense_segments
from loraplex.kernels.cpu_packed import add_lora_packed
from loraplex.kernels.metadata import build_lora_meta
from loraplex.kernels.reference import add_lora_segmented
from loraplex.kernels.weights import LoRAWeights
from tests.helpers import built_cpu_ext

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bgmv(enabled: bool, max_lanes: int = 16):
    """add_lora_bgmv in the compiled kernel, its path capped at max_lanes (16: AVX-512 where the CPU has
    it; 8: AVX2, fp32 only, on AVX-512 CPUs too; 0: scalar; a path the CPU or dtype lacks runs the next
    one down), or on embedding_bag."""
    def run(*args):
        saved = cpu_ext.enabled, cpu_ext.max_lanes
        cpu_ext.enabled, cpu_ext.max_lanes = enabled, max_lanes
        try:
            return add_lora_bgmv(*args)
        finally:
            cpu_ext.enabled, cpu_ext.max_lanes = saved
    return run


PATHS = {"segmented": add_lora_segmented, "packed": add_lora_packed, "bgmv": _bgmv(True),
         "bgmv_avx2": _bgmv(True, max_lanes=8), "bgmv_scalar": _bgmv(True, max_lanes=0), "bgmv_gather": _bgmv(False),
         "dense_segments": add_lora_dense_segments}


BGMV_IS_CPU = "bgmv is the CPU path: it reads the slot buffers' host-memory mirrors"
bgmv_test = pytest.mark.skipif(DEVICE == "cuda", reason=BGMV_IS_CPU)


def _run(path, case):
    if path.startswith("bgmv") and DEVICE == "cuda":
        pytest.skip(BGMV_IS_CPU)
    y_before = case.y.clone()
    out = PATHS[path](case.y, case.x, case.slices, case.meta, case.offsets)
    assert_matches(out, case, y_before)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_matches_dense(path, dtype, popularity, num_tokens):
    if popularity == "distinct" and num_tokens > 16:
        popularity = "uniform"  # 16 adapters at most: distinct rows need T <= 16
    num_adapters = min(num_tokens, 16) if popularity in ("distinct", "uniform") else 5
    # The packed path reads padding (times zero): it needs the engine's zero padding.
    padding = "nan" if path == "segmented" else "zero"
    _run(path, make_case(num_tokens, popularity, num_adapters, dtype, 100, [61], padding, seed=num_tokens))


@pytest.mark.parametrize("path", list(PATHS))
def test_fused_qkv_gqa(path):
    case = make_case(24, "uniform", 6, torch.bfloat16, 576, [576, 192, 192],
                     "nan" if path == "segmented" else "zero", seed=7)
    _run(path, case)


@pytest.mark.parametrize("block_diagonal_max", [0, 1024])
@pytest.mark.parametrize("popularity", ["identical", "skewed", "uniform"])
def test_packed_fused_slices_one_or_many_expands(monkeypatch, block_diagonal_max, popularity):
    """Adjacent slices (fused q/k/v) expand through one block-diagonal matmul or one matmul each."""
    monkeypatch.setattr(cpu_packed, "BLOCK_DIAGONAL_MAX_COLUMNS", block_diagonal_max)
    case = make_case(40, popularity, 3, torch.float32, 96, [96, 32, 32], "zero", seed=11)
    _run("packed", case)
    _run("packed", case)  # second call: weights from the cache


def test_dispatch_auto_and_forced(monkeypatch):
    case = make_case(12, "uniform", 3, torch.float32, 72, [61, 45], padding="zero", seed=8)
    # bgmv reads the slots' host-memory mirrors, which CUDA slots do not have; there Triton runs instead
    for backend in ("auto", "segmented", "packed", "bgmv" if DEVICE == "cpu" else "triton"):
        monkeypatch.setattr(lora_ops, "_backend", backend)
        y = case.y.clone()
        lora_ops.add_lora(y, case.x, case.slices, case.meta)  # default offsets: consecutive
        assert_matches(y, case, case.y)
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        lora_ops.set_backend("cublas")


# kernel: the CPU the compiled BGMV kernel runs on ("avx512": every dtype; "avx2": fp32 only), or None
@pytest.mark.parametrize("dtype, num_tokens, num_adapters, mirrors, kernel, expected", [
    (torch.bfloat16, 64, 6, True, "avx512", "packed"),  # N = 48
    (torch.bfloat16, 64, 8, True, "avx512", "bgmv"),  # N = 64
    (torch.bfloat16, 64, 64, True, "avx512", "bgmv"),  # N = 512: each row reads only its own adapter
    (torch.float32, 64, 6, True, "avx512", "packed"),  # fp32 where the compiled BGMV kernel runs: as bf16
    (torch.float32, 64, 7, True, "avx512", "bgmv"),  # N = 56
    (torch.float32, 64, 16, True, "avx512", "bgmv"),  # N = 128: the vllm preset's decode steps
    (torch.float32, 64, 16, True, "avx2", "bgmv"),  # the same on an AVX2-only CPU (its 8-lane fp32 path)
    (torch.float32, 64, 16, True, None, "packed"),  # without the kernel: fp32 stays packed up to N = 1024
    (torch.float32, 4096, 6, True, "avx512", "bgmv"),  # N = 48 but T x N = 192K: fp32's own T x N limit
    (torch.float32, 2048, 12, True, None, "bgmv"),  # fp32 on the gathers: N = 96 but T x N = 192K
    (torch.float32, 16, 12, True, None, "packed"),  # fp32 on the gathers: up to N = 1024
    (torch.bfloat16, 64, 64, False, "avx512", "segmented"),  # slot buffers without the CPU mirrors
])
def test_auto_picks_the_cpu_path_measured_fastest(monkeypatch, dtype, num_tokens, num_adapters, mirrors, kernel,
                                                  expected):
    monkeypatch.setattr(lora_ops, "_backend", "auto")

    def get(dtype=None):  # what cpu_ext.get answers on that CPU, for the dtype it is asked about
        runs = kernel == "avx512" or (kernel == "avx2" and dtype == torch.float32)
        return cpu_ext.load() if runs else None

    monkeypatch.setattr(lora_ops.cpu_ext, "get", get)
    if dtype == torch.float32 and kernel:
        built_cpu_ext()
    # a CPU step on every machine: the choice among CPU paths is made for CPU tensors only
    meta = build_lora_meta([t % num_adapters for t in range(num_tokens)], "cpu", slot_ranks=[8] * 64)
    w = LoRAWeights.empty(64, 8, 8, 8, dtype, "cpu")
    if not mirrors:
        w.AT = w.BT = None
    x = torch.zeros(num_tokens, 8, dtype=dtype)
    assert lora_ops._pick_backend(x, meta, [w]) == expected


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA step: needs a GPU")
def test_auto_picks_triton_on_cuda(monkeypatch):
    monkeypatch.setattr(lora_ops, "_backend", "auto")
    meta = build_lora_meta([t % 8 for t in range(64)], DEVICE, slot_ranks=[8] * 64)
    w = LoRAWeights.empty(64, 8, 8, 8, torch.bfloat16, DEVICE)
    assert lora_ops._pick_backend(torch.zeros(64, 8, dtype=torch.bfloat16, device=DEVICE), meta, [w]) == "triton"


@bgmv_test
def test_bgmv_sends_long_segments_through_dense_matmuls(monkeypatch):
    """A long prefill chunk among many short segments: the chunk's rows take a dense matmul pair, the
    others go through bgmv, and the sum matches the dense truth."""
    slot_ids = [0] * 40 + list(range(1, 17)) * 2  # one 40-row segment, 16 two-row segments
    case = make_case(len(slot_ids), "uniform", 16, torch.float32, 64, [48, 16], "zero", seed=12)
    case.slot_ids[:] = slot_ids
    case.x.copy_(torch.randn(case.x.shape))  # make_case put NaN in the rows it left without an adapter
    case.y.copy_(torch.randn(case.y.shape))
    case.meta = build_lora_meta(slot_ids, DEVICE, slot_ranks=case.meta.slot_ranks)
    calls = []
    for name in ("add_lora_dense_segments", "add_lora_bgmv"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, real=real, name=name: calls.append(
            (name, a[3].row_order.numel())) or real(*a))
    monkeypatch.setattr(lora_ops, "_backend", "auto")
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS", {torch.float32: (16, 1 << 20)})  # fp32 without the kernel
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS_16BIT", (16, 1 << 20))  # and with it
    monkeypatch.setattr(cpu_bgmv, "LONG_SEGMENT_ROWS", 32)
    y = case.y.clone()
    lora_ops.add_lora(y, case.x, case.slices, case.meta, case.offsets)
    assert calls == [("add_lora_dense_segments", 40), ("add_lora_bgmv", 32)]
    assert_matches(y, case, case.y)


def test_projection_no_active_adapter_targets_is_skipped(monkeypatch):
    """Adapters on q/k/v/o only: the MLP's slots are empty (rank 0), so no path runs for them."""
    case = make_case(12, "uniform", 3, torch.float32, 72, [61], padding="zero", seed=9)
    active = set(case.meta.seg_slots_list)
    for s in active:
        case.slices[0].set_slot(s, None, None, 0.0)
    for backend in ("auto", "segmented", "packed", "bgmv", "triton"):
        monkeypatch.setattr(lora_ops, "_backend", backend)
        monkeypatch.setattr(lora_ops, "add_lora_segmented", None)  # any call would raise
        monkeypatch.setattr(cpu, "add_lora_packed", None)
        monkeypatch.setattr(cpu, "add_lora_bgmv", None)
        y = case.y.clone()
        assert torch.equal(lora_ops.add_lora(y, case.x, case.slices, case.meta), case.y)


def test_segments_group_rows_stably():
    meta = build_lora_meta([2, -1, 0, 2, 0], DEVICE)
    assert meta.row_order.tolist() == [2, 4, 0, 3]
    assert (meta.seg_slots_list, meta.seg_starts_list, meta.seg_lens_list) == ([0, 2], [0, 2], [2, 2])
    assert meta.max_seg_len == 2 and meta.has_lora
    assert not build_lora_meta([-1, -1]).has_lora
    with pytest.raises(ValueError):
        build_lora_meta([0, -2])


@pytest.mark.parametrize("block_m", [1, 2, 16])
def test_row_tiles_cover_each_adapter_row_once(block_m):
    slot_ids = [3, -1, 0, 3, 0, 3, 3, 1, -1, 3]
    meta = build_lora_meta(slot_ids, DEVICE)
    tiles = meta.row_tiles(block_m).tolist()
    assert meta.row_tiles(block_m) is meta.row_tiles(block_m)  # cached for every layer of the step
    covered = []
    for slot, first, end in tiles:
        assert 0 < end - first <= block_m
        rows = meta.row_order[first:end].tolist()
        assert all(slot_ids[t] == slot for t in rows)
        covered += rows
    assert sorted(covered) == [t for t, s in enumerate(slot_ids) if s >= 0]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [8, 16])
@pytest.mark.parametrize("popularity", ["distinct", "zipf", "identical"])
def test_paged_slots_match_dense(path, dtype, page, popularity):
    """Adapters of ranks 4-64 packed by rank into pages of shared physical slots (S-LoRA's unified
    paging): every CPU path reads each row's adapter at its virtual slot and nothing of its neighbours."""
    case = make_case(33, popularity, 8, dtype, 96, [80, 24], "nan" if path == "segmented" else "zero",
                     seed=page, page=page)
    _run(path, case)


@bgmv_test
@pytest.mark.parametrize("page", [0, 8])
def test_bgmv_slices_with_their_own_shrink_mirrors(page):
    """Slices made one by one (`LoRAWeights.empty`, each its own AT) rather than as a fused group: bgmv
    shrinks each through its own mirror (one gather per mirror), not through the first slice's."""
    case = make_case(29, "zipf", 8, torch.float32, 40, [32, 16, 16], "zero", seed=31, page=page)
    alone = []
    for w in case.slices:
        own = LoRAWeights.empty(w.A.shape[0], w.A.shape[1], w.A.shape[2], w.B.shape[1], w.A.dtype, "cpu", page=page,
                                shrink_mirror=True)
        for s, r in enumerate(w.ranks_list):
            if r:
                own.set_slot(s, w.a_rows(s, r), w.b_cols(s, r), w.scales_list[s])
        alone.append(own)
    assert len({w.AT.data_ptr() for w in alone}) == 3
    y = case.y.clone()
    PATHS["bgmv_gather"](y, case.x, alone, case.meta, case.offsets)
    assert_matches(y, case, case.y)


def test_bgmv_step_of_only_long_segments_takes_dense_matmuls(monkeypatch):
    """Every segment a long prefill chunk: no row goes through bgmv."""
    slot_ids = [0] * 40 + [1] * 36
    case = make_case(len(slot_ids), "uniform", 2, torch.float32, 64, [48], "zero", seed=13)
    case.slot_ids[:] = slot_ids
    case.x.copy_(torch.randn(case.x.shape))
    case.y.copy_(torch.randn(case.y.shape))
    case.meta = build_lora_meta(slot_ids, DEVICE, slot_ranks=case.meta.slot_ranks)
    monkeypatch.setattr(lora_ops, "_backend", "auto")
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS", {torch.float32: (4, 1 << 20)})
    monkeypatch.setattr(lora_ops, "PACKED_LIMITS_16BIT", (4, 1 << 20))
    monkeypatch.setattr(cpu_bgmv, "LONG_SEGMENT_ROWS", 32)
    monkeypatch.setattr(cpu, "add_lora_bgmv", None)  # any call would raise
    y = case.y.clone()
    lora_ops.add_lora(y, case.x, case.slices, case.meta, case.offsets)
    assert_matches(y, case, case.y)


def test_bgmv_without_slot_ranks_is_refused():
    case = make_case(4, "uniform", 2, torch.float32, 16, [8], "zero", seed=15)
    meta = build_lora_meta(case.slot_ids, DEVICE)
    with pytest.raises(ValueError, match="slot_ranks"):
        add_lora_bgmv(case.y.clone(), case.x, case.slices, meta, case.offsets)


def _buffers(w: LoRAWeights) -> list:
    return [w.A, w.B, w.AT, w.BT, w.ranks, w.scales, w.ranks_list, w.scales_list]


def test_stack_writes_every_layer_as_per_layer_writes_would():
    """LoRAStack.set_slot (all layers in one copy per buffer) leaves each layer's buffers, mirrors,
    ranks and scales exactly as LoRAWeights.set_slot layer by layer, including a layer the adapter
    leaves alone and a layer of lower rank (rank_pattern); a smaller adapter written over a larger one
    and a clear zero the previous rows."""
    from loraplex.kernels import LoRAStack

    gen = torch.Generator().manual_seed(21)
    L, S, R, H_in, H_out, page = 3, 2, 16, 12, 10, 4
    stack = LoRAStack.empty(L, S, R, H_in, H_out, torch.bfloat16, "cpu", page=page, shrink_mirror=True)
    singles = [LoRAWeights.empty(S, R, H_in, H_out, torch.bfloat16, "cpu", page=page, shrink_mirror=True)
               for _ in range(L)]

    def write(slot, r, ranks, scales):
        A = torch.randn(L, r, H_in, generator=gen)
        B = torch.randn(L, H_out, r, generator=gen)
        for layer, rank in enumerate(ranks):  # the loader's zero padding past each layer's rank
            A[layer, rank:] = 0
            B[layer, :, rank:] = 0
        stack.set_slot(slot, A, B, ranks, scales)
        for layer, (w, rank, scale) in enumerate(zip(singles, ranks, scales, strict=True)):
            w.set_slot(slot, A[layer, :rank] if rank else None, B[layer, :, :rank] if rank else None, scale)

    def check():
        for layer, w in enumerate(singles):
            for got, want in zip(_buffers(stack.layers[layer]), _buffers(w), strict=True):
                assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want

    write(1, 8, [8, 0, 4], [2.0, 0.0, 0.5])  # virtual slot 1: rows 4..11 of physical slot 0
    write(4, 16, [16, 16, 16], [1.0, 1.0, 1.0])  # physical slot 1, whole
    check()
    write(4, 4, [4, 4, 4], [3.0, 3.0, 3.0])  # smaller adapter over the larger one: rows 4..15 zeroed
    check()
    assert not stack.A[:, 1, 4:].any() and not stack.BT[:, 1, 4:].any()
    stack.set_slot(1, None, None)
    for w in singles:
        w.set_slot(1, None, None, 0.0)
    check()
    assert not stack.A[:, 0].any() and not stack.AT[:, 0].any() and stack.rows == [0, 0, 0, 0, 4, 0, 0, 0]
    with pytest.raises(ValueError, match="do not fit slot buffers of 3 layers, max rank 16"):
        stack.set_slot(3, torch.zeros(L, 8, H_in), torch.zeros(L, H_out, 8), [8] * L, [1.0] * L)  # rows 12..19
    with pytest.raises(ValueError, match="do not fit"):
        stack.set_slot(0, torch.zeros(L - 1, 4, H_in), torch.zeros(L - 1, H_out, 4), [4] * 2, [1.0] * 2)


@pytest.mark.parametrize("ranks", [(16, 4), (12, 5), (6, 3), (3, 6), (8, 8), (5, 12)])
def test_a_write_over_another_leaves_what_a_write_into_empty_buffers_does(ranks):
    """A write zeroes only what it leaves of the previous adapter's rows (not all of them first): after
    writing rank ranks[0] then ranks[1] at one slot, every buffer, CPU mirror and page equals a write of
    the second adapter alone, for one layer (LoRAWeights) and for a stack, ranks across page edges."""
    from loraplex.kernels import LoRAStack

    gen = torch.Generator().manual_seed(sum(ranks))
    L, S, R, H_in, H_out, page = 2, 2, 16, 12, 10, 4
    weights = [(torch.randn(L, r, H_in, generator=gen), torch.randn(L, H_out, r, generator=gen)) for r in ranks]

    def stack_of(writes):
        stack = LoRAStack.empty(L, S, R, H_in, H_out, torch.bfloat16, "cpu", page=page, shrink_mirror=True)
        for A, B in writes:
            stack.set_slot(4, A, B, [A.shape[1]] * L, [2.0] * L)
        return stack

    def single_of(writes):
        w = LoRAWeights.empty(S, R, H_in, H_out, torch.bfloat16, "cpu", page=page, shrink_mirror=True)
        for A, B in writes:
            w.set_slot(4, A[0], B[0], 2.0)
        return w

    pairs = [(stack_of(weights).layers, stack_of(weights[1:]).layers),
             ([single_of(weights)], [single_of(weights[1:])])]
    for got_layers, want_layers in pairs:
        for got, want in zip(got_layers, want_layers, strict=True):
            for a, b in zip(_buffers(got), _buffers(want), strict=True):
                assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b


def test_weights_built_from_ranks_know_their_live_slots():
    """LoRAWeights made directly (not through set_slot) derive `live` from ranks_list, so add_lora does
    not skip them as a projection no adapter targets."""
    case = make_case(6, "uniform", 3, torch.float32, 16, [8], "zero", seed=17)
    w = case.slices[0]
    rebuilt = LoRAWeights(A=w.A, B=w.B, ranks=w.ranks, scales=w.scales, ranks_list=list(w.ranks_list),
                          scales_list=list(w.scales_list), page=w.page)
    assert rebuilt.live == {s for s, r in enumerate(w.ranks_list) if r} and rebuilt.live
    y = case.y.clone()
    lora_ops.add_lora(y, case.x, [rebuilt], case.meta, case.offsets)
    assert_matches(y, case, case.y)
