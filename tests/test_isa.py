"""`LORAPLEX_CPU_ISA=avx2` (loraplex/isa.py): what it sets, what it refuses, and where it reaches (our
kernels' build flags, dtype="auto", the reports' CPU line, the bench server's environment, vLLM's
peer). Building the held kernels takes minutes, so it is not done here: that a held build sees no
AVX-512 is checked by hand (docs/performance.md, fourteenth Zen 4 session)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.cpu

from loraplex import isa


@pytest.mark.parametrize("value, want", [(None, None), ("", None), ("auto", None), (" AVX2 ", "avx2"),
                                         ("avx2", "avx2")])
def test_cap_reads_the_variable(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(isa.ENV, raising=False)
    else:
        monkeypatch.setenv(isa.ENV, value)
    assert isa.cap() == want
    assert isa.describe().startswith(" (held to AVX2: LORAPLEX_CPU_ISA=avx2, ATEN_CPU_CAPABILITY=") == bool(want)
    assert (isa.describe() == "") == (not want)


def test_cap_refuses_other_values(monkeypatch):
    monkeypatch.setenv(isa.ENV, "sse4")
    with pytest.raises(ValueError, match=r"LORAPLEX_CPU_ISA='sse4': choose one of auto, avx2"):
        isa.cap()


def test_apply_sets_torch_and_onednn_only_where_unset(monkeypatch):
    for name in (isa.ENV, *isa.TORCH_ENV):  # set, then deleted: monkeypatch restores them afterwards
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    assert isa.apply() is False and "ATEN_CPU_CAPABILITY" not in os.environ
    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")  # the environment's choice stays
    assert isa.apply() is False  # torch is loaded in this process: its own dispatch is already fixed
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"


def _in_fresh_python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", isa.ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=environ | env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_held_process_has_torch_on_avx2_and_its_own_kernel_build():
    """Before torch loads, `import loraplex` holds PyTorch to AVX2; the kernels get other build flags, so
    another build name (never a library built with AVX-512), and dtype="auto" picks fp32."""
    code = ("import loraplex, torch; from loraplex.kernels import cpu_ext; from loraplex.engine import llm_engine; "
            "print(torch.backends.cpu.get_cpu_capability(), cpu_ext.module_name(), ' '.join(cpu_ext.CFLAGS), "
            "llm_engine.pick_dtype('auto', torch.device('cpu')))")
    held = _in_fresh_python(code, LORAPLEX_CPU_ISA="avx2").split()
    free = _in_fresh_python(code).split()
    assert held[0] == "AVX2" and held[-1] == "torch.float32"
    assert "-DLORAPLEX_NO_AVX512" in held and "-DLORAPLEX_NO_AVX512" not in free
    assert held[1] != free[1] and held[1].startswith("loraplex_cpu_")


def test_held_cpus_have_no_fast_bf16(monkeypatch, tmp_path):
    from loraplex.engine.llm_engine import cpu_has_fast_bf16

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 fma avx512f avx512bw avx512_bf16\n")
    monkeypatch.delenv(isa.ENV, raising=False)
    assert cpu_has_fast_bf16(cpuinfo) is True
    monkeypatch.setenv(isa.ENV, "avx2")
    assert cpu_has_fast_bf16(cpuinfo) is False


def test_reports_say_the_run_was_held(monkeypatch):
    from loraplex.bench.report import cpu_flags

    monkeypatch.delenv(isa.ENV, raising=False)
    free = cpu_flags()
    monkeypatch.setenv(isa.ENV, "avx2")
    for name, value in isa.TORCH_ENV.items():
        monkeypatch.setenv(name, value)
    assert cpu_flags() == free + (" (held to AVX2: LORAPLEX_CPU_ISA=avx2, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, "
                                  f"MKL_ENABLE_INSTRUCTIONS=AVX2; PyTorch's kernels: {torch.backends.cpu.get_cpu_capability()})")


def test_reports_name_the_command_with_the_hold(monkeypatch):
    from loraplex.bench.report import command_line

    monkeypatch.delenv(isa.ENV, raising=False)
    assert command_line(["--preset", "vllm", "--out", "a b.md"]) == "loraplex bench --preset vllm --out 'a b.md'"
    monkeypatch.setenv(isa.ENV, "avx2")
    assert command_line(["--preset", "vllm"]) == "LORAPLEX_CPU_ISA=avx2 loraplex bench --preset vllm"


def test_the_bench_server_keeps_the_hold(monkeypatch, tmp_path):
    from loraplex.bench.http_client import server_environ

    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://elsewhere:6379")
    env = server_environ(None, home=tmp_path, port=1, admin_key="k")
    assert env[isa.ENV] == "avx2" and "LORAPLEX_REDIS_URL" not in env


def test_vllm_peer_reads_which_kernel_library_its_processes_mapped(tmp_path):
    """The peer's check after loading vLLM: the `.abi3.so` libraries mapped in it and its children."""
    from loraplex.bench import vllm_peer

    assert vllm_peer.vllm_kernels() == []  # no vLLM in this process or its children
    lib = tmp_path / "vllm" / "_C_AVX2.abi3.so"  # a file of that name, mapped by a child process
    lib.parent.mkdir()
    lib.write_bytes(b"\0" * 4096)
    code = f"import mmap, sys; f = open({str(lib)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); " \
           "print('mapped', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mapped"
        assert vllm_peer.vllm_kernels() == ["_C_AVX2"]
    finally:
        child.communicate("", timeout=30)


def test_every_process_of_the_vllm_peer_is_held(monkeypatch, tmp_path):
    """The bench starts the peer with a sitecustomize beside its script: a Python started with that
    environment (as vLLM's engine core is) has torch.cpu's AVX-512 checks false before anything runs."""
    from loraplex.bench import systems, vllm_peer

    (tmp_path / "vllm_peer.py").write_text((Path(vllm_peer.__file__)).read_text())
    monkeypatch.delenv(isa.ENV, raising=False)
    assert "PYTHONPATH" not in systems.vllm_peer_environ(tmp_path) or str(tmp_path) not in os.environ.get("PYTHONPATH", "")
    assert not (tmp_path / "sitecustomize.py").exists()
    monkeypatch.setenv(isa.ENV, "avx2")
    env = systems.vllm_peer_environ(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    out = subprocess.run([sys.executable, "-c", "import sys, torch.cpu; print(torch.cpu._is_avx512_supported(), "
                          "torch.cpu._is_avx512_bf16_supported(), 'torch' in sys.modules)"],
                         env=env, capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]


def test_vllm_peer_loads_vllms_avx2_kernels_when_held(monkeypatch):
    """vLLM 0.32 picks `vllm._C_AVX2` where torch.cpu says the CPU lacks AVX-512; the peer says so."""
    from loraplex.bench import vllm_peer

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", torch.cpu._is_avx512_supported)  # restored after
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", torch.cpu._is_avx512_bf16_supported)
    monkeypatch.delenv(isa.ENV, raising=False)
    before = torch.cpu._is_avx512_supported
    assert vllm_peer.hold_to_avx2() is False and torch.cpu._is_avx512_supported is before
    monkeypatch.setenv(isa.ENV, "avx2")
    assert vllm_peer.hold_to_avx2() is True
    assert torch.cpu._is_avx512_supported() is False and torch.cpu._is_avx512_bf16_supported() is False
