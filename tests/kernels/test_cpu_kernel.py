"""The compiled CPU BGMV kernel (loraplex/kernels/csrc/bgmv_cpu.cpp): that it builds here, and what it
refuses. Its maths is checked against the dense truth with the other CPU paths (test_lora_reference)."""

import pytest
import torch
from lora_cases import assert_matches, make_case

from loraplex import isa
from loraplex.kernels import LoRAWeights, cpu_ext
from loraplex.kernels.cpu_bgmv import add_lora_bgmv

# The CPU path: on a GPU machine make_case builds CUDA batches, and the Triton tests cover the kernels.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernel is the CPU path")


@pytest.fixture(scope="module")
def ext():
    return cpu_ext.load()


def test_builds_and_serves_the_engine_only_where_a_vector_path_takes_the_dtype(ext):
    """CI's machine has a compiler: the kernel must build there, not fall back to the gathers; the
    engine gets it where the CPU has AVX-512, and for fp32 where it has AVX2 + FMA (its scalar path is
    slower than the gathers)."""
    assert ext is not None
    flags = open("/proc/cpuinfo").read().split()
    held = isa.cap() == "avx2"  # LORAPLEX_CPU_ISA=avx2: built without AVX-512 (loraplex/isa.py)
    assert ext.avx512_available() == (not held and all(f in flags for f in ("avx512f", "avx512bw", "avx512vl",
                                                                             "avx512dq")))
    assert ext.avx512_bf16_available() == (ext.avx512_available() and "avx512_bf16" in flags)
    assert ext.avx2_available() == ("avx2" in flags and "fma" in flags)
    assert (cpu_ext.get() is ext) == ext.avx512_available()
    assert (cpu_ext.get(torch.bfloat16) is ext) == ext.avx512_available()
    assert (cpu_ext.get(torch.float32) is ext) == (ext.avx512_available() or ext.avx2_available())
    # the path each call takes: the widest the CPU and dtype have, capped by max_lanes
    wide, avx2 = ext.avx512_available(), ext.avx2_available()
    assert ext.bgmv_lanes(True, 16) == (16 if wide else 8 if avx2 else 0)
    assert ext.bgmv_lanes(False, 16) == (16 if wide else 0)
    assert ext.bgmv_lanes(True, 8) == (8 if avx2 else 0) and ext.bgmv_lanes(False, 8) == 0
    assert ext.bgmv_lanes(True, 0) == 0 == ext.bgmv_lanes(False, 0)
    assert cpu_ext.module_name().startswith("loraplex_cpu_")
    assert (cpu_ext.build_root() / cpu_ext.module_name() / f"{cpu_ext.module_name()}.so").exists()


def test_load_build_opens_a_built_library_beside_the_loaded_one(ext, tmp_path):
    """The benches' A/B loader: the same library file, opened again by path, computes what the loaded
    module does; a file that is no extension is refused with ImportError."""
    built = cpu_ext.build_root() / cpu_ext.module_name() / f"{cpu_ext.module_name()}.so"
    again = cpu_ext.load_build(built)
    assert again.__name__ == cpu_ext.module_name()
    x = torch.randn(5, 64)
    w = torch.randn(48, 64)
    isa = "avx512" if ext.avx512_available() else "avx2"
    if ext.avx2_available():
        out = again.gemm_linear(x, again.gemm_pack(w, isa, 0), 48, isa, None, 0, False)
        assert torch.equal(out, ext.gemm_linear(x, ext.gemm_pack(w, isa, 0), 48, isa, None, 0, False))
    gate_up = torch.randn(3, 8)
    assert torch.equal(again.silu_mul(gate_up), ext.silu_mul(gate_up))
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not a library")
    with pytest.raises(ImportError):
        cpu_ext.load_build(bogus)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(monkeypatch):
    """PyTorch's loader waits forever on the lock file of a build that was killed; loraplex holds its
    own OS lock while building, so such a file is stale and removed."""
    import threading

    (cpu_ext.build_root() / cpu_ext.module_name() / "lock").touch()
    monkeypatch.setattr(cpu_ext, "_tried", False)
    monkeypatch.setattr(cpu_ext, "_module", None)
    loader = threading.Thread(target=cpu_ext.load, daemon=True)
    loader.start()
    loader.join(timeout=120)
    assert not loader.is_alive() and cpu_ext._module is not None
    assert not (cpu_ext.build_root() / cpu_ext.module_name() / "lock").exists()


def test_a_start_that_waits_for_another_process_building_says_so(ext, monkeypatch, caplog):
    """The build lock held by another process (here: this test, through another open file, which flock
    treats as another holder): the loader logs that it waits, instead of a silent start that looks hung.
    (`ext`: built already, so the loader only loads once the lock is free.)"""
    import fcntl
    import logging
    import threading

    monkeypatch.setattr(cpu_ext, "_tried", False)
    monkeypatch.setattr(cpu_ext, "_module", None)
    with open(cpu_ext.build_root() / f"{cpu_ext.module_name()}.lock", "w") as held, \
            caplog.at_level(logging.WARNING, logger=cpu_ext.logger.name):
        fcntl.flock(held, fcntl.LOCK_EX)
        loader = threading.Thread(target=cpu_ext.load, daemon=True)
        loader.start()
        for _ in range(200):
            if "waiting for another process" in caplog.text:
                break
            loader.join(timeout=0.05)
        assert loader.is_alive() and "waiting for another process to finish building the CPU kernels" in caplog.text
        fcntl.flock(held, fcntl.LOCK_UN)
    loader.join(timeout=120)
    assert not loader.is_alive() and cpu_ext._module is not None


def test_a_build_lock_held_past_the_limit_leaves_the_kernels_off(ext, monkeypatch, caplog):
    """A holder that never lets go (stopped, hung): after BUILD_WAIT_S the start goes on without the
    kernels, and says why."""
    import fcntl
    import logging

    monkeypatch.setattr(cpu_ext, "_tried", False)
    monkeypatch.setattr(cpu_ext, "_module", None)
    monkeypatch.setattr(cpu_ext, "BUILD_WAIT_S", 1.0)
    with open(cpu_ext.build_root() / f"{cpu_ext.module_name()}.lock", "w") as held, \
            caplog.at_level(logging.WARNING, logger=cpu_ext.logger.name):
        fcntl.flock(held, fcntl.LOCK_EX)
        assert cpu_ext.load() is None
    assert "CPU kernels not built (TimeoutError: another process held the build lock" in caplog.text


def _args(case):
    order = case.meta.row_order
    sid = case.meta.slot_ids.to(torch.int64)[order]
    w = case.slices[0]
    a, bt = w.A.view(-1, w.A.shape[2]), w.BT.view(-1, w.BT.shape[-1])  # what the dispatch hands the kernel
    return case.y.clone(), case.x, order, sid, [a], [bt], [w.ranks], [0], w.page, 16


def test_refuses_rows_and_slots_out_of_range_without_writing(ext):
    case = make_case(6, "uniform", 3, torch.float32, 32, [16], "zero", seed=3)
    y, x, order, sid, a, bt, ranks, offsets, page, vec = _args(case)
    before = y.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        ext.bgmv(y, x, order, sid + 10_000, a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="row out of range or repeated"):
        ext.bgmv(y, x, order + 6, sid, a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="row out of range or repeated"):  # two threads on one row
        ext.bgmv(y, x, order[[0, 0]], sid[[0, 0]], a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="runs past y"):
        ext.bgmv(y, x, order, sid, a, bt, ranks, [1], page, vec)
    with pytest.raises(RuntimeError, match="runs past y"):  # offset + H_out would overflow int64
        ext.bgmv(y, x, order, sid, a, bt, ranks, [2**63 - 1], page, vec)
    with pytest.raises(RuntimeError, match="one A, BT, ranks and offset per slice"):
        ext.bgmv(y, x, order, sid, a, bt, ranks, offsets, 2**62, vec)  # V x page would overflow
    with pytest.raises(RuntimeError, match="rows of y overlap"):
        ext.bgmv(y[:1].expand(6, -1), x, order, sid, a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="x and y overlap"):  # x is read in place while y is written
        both = torch.zeros(x.shape[0], x.shape[1] + y.shape[1], dtype=x.dtype)
        ext.bgmv(both[:, x.shape[1] // 2 :][:, : y.shape[1]], both[:, : x.shape[1]], order, sid, a, bt, ranks,
                 offsets, page, vec)
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        ext.bgmv(y.to("meta"), x.to("meta"), order, sid, a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="unsupported dtype Double"):
        ext.bgmv(y.double(), x.double(), order, sid, a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="one dtype"):
        ext.bgmv(y.half(), x, order, sid, a, bt, ranks, offsets, page, vec)
    with pytest.raises(RuntimeError, match="in the dtype of x"):
        ext.bgmv(y.half(), x.half(), order, sid, a, bt, ranks, offsets, page, vec)
    assert torch.equal(y.view(torch.int32), before.view(torch.int32))  # bits: idle rows hold NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slot_buffers_skip_the_gathers_mirror_where_the_kernel_is_built(ext, monkeypatch, dtype):
    """Buffers made by default have no AT where the kernel runs their dtype (only the embedding_bag
    gathers read it): the compiled path runs on them and matches the dense truth; the gathers refuse
    them with a clear error. Elsewhere (bf16 without AVX-512) they keep AT."""
    case = make_case(24, "zipf", 8, dtype, 64, [48, 16], "zero", seed=5, page=8)
    plain = LoRAWeights.empty_group(*case.slices[0].A.shape[:3], [w.B.shape[1] for w in case.slices],
                                    dtype, "cpu", page=8)
    if cpu_ext.get(dtype) is None:
        assert all(w.AT is not None for w in plain)
        pytest.skip(f"no vector path here for {dtype}: it runs the gathers, so its buffers keep AT")
    assert all(w.AT is None and w.BT is not None for w in plain)
    for w, full in zip(plain, case.slices, strict=True):
        for s, r in enumerate(full.ranks_list):
            if r:
                w.set_slot(s, full.a_rows(s, r), full.b_cols(s, r), full.scales_list[s])
    y = case.y.clone()
    add_lora_bgmv(y, case.x, plain, case.meta, case.offsets)
    assert_matches(y, case, case.y)
    monkeypatch.setattr(cpu_ext, "enabled", False)
    with pytest.raises(ValueError, match="gathers read the AT shrink mirrors"):
        add_lora_bgmv(case.y.clone(), case.x, plain, case.meta, case.offsets)


def test_turned_off_or_unbuildable_falls_back_to_the_gathers(monkeypatch, caplog):
    monkeypatch.setattr(cpu_ext, "enabled", False)
    assert cpu_ext.get() is None
    monkeypatch.setattr(cpu_ext, "enabled", True)
    monkeypatch.setattr(cpu_ext, "_tried", False)
    monkeypatch.setattr(cpu_ext, "_module", None)
    missing = cpu_ext.CSRC / "missing.cpp"
    monkeypatch.setattr(cpu_ext, "SOURCES", [*cpu_ext.SOURCES, missing])
    with caplog.at_level("WARNING", logger="loraplex.kernels.cpu_ext"):
        assert cpu_ext.get() is None
        assert cpu_ext.get() is None  # tried once: no second build, no second warning
    assert [r.getMessage() for r in caplog.records] == [
        f"CPU kernels not built (FileNotFoundError: [Errno 2] No such file or directory: {str(missing)!r}); "
        "many-adapter CPU steps use the slower embedding_bag gathers, and attention gathers the KV cache for "
        "PyTorch's sdpa"]
