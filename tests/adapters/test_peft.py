"""PEFT adapter loading: parity with what PEFT itself builds, and one test per refusal."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from loraplex.adapters import AdapterError, load_peft_adapter, load_peft_files, validate_peft_adapter
from loraplex.adapters.peft_config import model_module_names
from loraplex.adapters.safetensors_check import read_safetensors_header

peft = pytest.importorskip("peft")

MAX_RANK = 16
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def peft_lora_modules(peft_model) -> dict[tuple[int, str], tuple[int, float, torch.Tensor, torch.Tensor]]:
    """What PEFT built: {(layer, module): (r, scaling, A [r, H_in], B [H_out, r])} of its lora layers."""
    out = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and "default" in module.r:
            m = re.fullmatch(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)", name)
            assert m, name
            out[(int(m[1]), m[2])] = (
                module.r["default"],
                module.scaling["default"],
                module.lora_A["default"].weight.detach(),
                module.lora_B["default"].weight.detach(),
            )
    return out


def edit_config(path: Path, **changes) -> dict:
    """Set fields of path/adapter_config.json; returns the new config."""
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return config


def edit_tensors(path: Path, fn) -> None:
    """Rewrite path/adapter_model.safetensors with fn(dict of tensors) (fn edits the dict in place)."""
    from safetensors.torch import load_file, save_file

    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def write_raw_safetensors(
    file: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None
) -> None:
    """A safetensors file from parts, valid or not: u64 header length, header bytes, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def load(path, model_config, **kwargs):
    return load_peft_adapter(
        path, model_config, max_lora_rank=kwargs.pop("max_lora_rank", MAX_RANK), **kwargs
    )


def assert_matches_peft(adapter, peft_model):
    expected = peft_lora_modules(peft_model)
    assert set(adapter.modules) == set(expected)
    for key, (r, scaling, A, B) in expected.items():
        got = adapter.modules[key]
        assert got.rank == r, key
        assert got.scaling == scaling, key
        assert torch.equal(got.A, A) and torch.equal(got.B, B), key
    assert adapter.rank == max(r for r, *_ in expected.values())
    for module, s in adapter.stacked.items():  # what the engine copies: zeros past each layer's rank
        for layer, r in enumerate(s.ranks):
            assert (r > 0) == ((layer, module) in expected), (layer, module)
            assert not s.A[layer, r:].any() and not s.B[layer, :, r:].any(), (layer, module)


# --- parity with PEFT ------------------------------------------------------------------------------

PARITY_CASES = {
    "list": dict(target_modules=["q_proj", "v_proj"]),
    "regex": dict(target_modules=r".*\.layers\.[13]\.(self_attn\.(q|k)_proj|mlp\.down_proj)"),
    "all_linear": dict(target_modules="all-linear"),
    # keys are in sorted order, so PEFT's save (which sorts them) keeps the first-match winner
    "rank_pattern": dict(
        target_modules="all-linear",
        rank_pattern={"k_proj": 2, "layers.2.mlp.up_proj": 6, r"model\.layers\.3\..*": 3},
    ),
    "alpha_pattern": dict(
        target_modules=["v_proj", "down_proj", "o_proj"],
        lora_alpha=16,
        alpha_pattern={"down_proj": 3.5, r"model\.layers\.[02]\.self_attn\.v_proj": 32},
    ),
    "rslora": dict(
        target_modules=["q_proj", "up_proj"], r=4, lora_alpha=8, use_rslora=True, rank_pattern={"up_proj": 8}
    ),
    "layers_list": dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1, 3]),
    "layers_int_pattern": dict(target_modules=["k_proj"], layers_to_transform=2, layers_pattern="layers"),
    "layers_pattern_empty": dict(target_modules=["v_proj"], layers_to_transform=[2], layers_pattern=""),
    "layers_pattern_list": dict(
        target_modules=["o_proj"], layers_to_transform=[0], layers_pattern=["blocks", "layers"]
    ),
    "exclude_list": dict(
        target_modules="all-linear", exclude_modules=["down_proj", "model.layers.0.self_attn.q_proj"]
    ),
    "exclude_regex": dict(target_modules=["q_proj", "gate_proj"], exclude_modules=r".*\.layers\.1\..*"),
    # an exact full name is taken whatever layers_to_transform says (short lists only)
    "exact_name_skips_layers": dict(
        target_modules=["model.layers.0.self_attn.q_proj", "k_proj"], layers_to_transform=[1]
    ),
    # >= 20 entries: PEFT rewrites the list into suffixes, and then layers_to_transform applies to all
    "long_list_layers": dict(
        target_modules=[
            f"model.layers.{i}.{b}.{m}"
            for i in range(4)
            for b, m in (
                ("self_attn", "q_proj"),
                ("self_attn", "k_proj"),
                ("self_attn", "v_proj"),
                ("mlp", "up_proj"),
                ("mlp", "gate_proj"),
            )
        ],
        layers_to_transform=[1],
    ),
    # >= 20 entries that cannot be shortened (each layer's q_proj separately): exact names again
    "long_list_unshortened": dict(
        target_modules=[f"model.layers.{i}.self_attn.q_proj" for i in range(20)],
        layers_to_transform=[3],
        model_overrides=dict(num_hidden_layers=24),
    ),
}

# The PEFT quirks above, spelled out: {case: module set}.
EXPECTED_MODULES = {
    "exact_name_skips_layers": {(0, "q_proj"), (1, "k_proj")},
    "long_list_layers": {(1, m) for m in ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj")},
    "long_list_unshortened": {(i, "q_proj") for i in range(20)},
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_matches_peft(case, make_adapter, make_llama, make_model_config):
    kwargs = dict(PARITY_CASES[case])
    overrides = kwargs.get("model_overrides", {})
    path, peft_model = make_adapter(**kwargs)
    adapter = load(path, make_model_config(**overrides))
    assert_matches_peft(adapter, peft_model)
    if case in EXPECTED_MODULES:
        assert set(adapter.modules) == EXPECTED_MODULES[case]
    # PEFT's own loader of the saved directory agrees too
    reloaded = peft.PeftModel.from_pretrained(make_llama(**overrides), path)
    assert_matches_peft(adapter, reloaded)


def test_all_linear_string_and_null_targets_in_json(make_adapter, model_config):
    path, peft_model = make_adapter(target_modules="all-linear")
    edit_config(path, target_modules="ALL-LINEAR")  # PEFT saves the expanded list; the string must work too
    assert_matches_peft(load(path, model_config), peft_model)

    path, peft_model = make_adapter("default", target_modules=None)  # PEFT's llama default: q_proj, v_proj
    edit_config(path, target_modules=None)
    adapter = load(path, model_config)
    assert_matches_peft(adapter, peft_model)
    assert {m for _, m in adapter.modules} == {"q_proj", "v_proj"}


def test_module_names_match_transformers(model_config, make_llama):
    assert model_module_names(model_config) == [n for n, _ in make_llama().named_modules()]


def test_adapter_fields_dtype_and_validate(make_adapter, model_config):
    path, peft_model = make_adapter(target_modules=["q_proj"], lora_alpha=8, task_type="CAUSAL_LM")
    adapter = load(path, model_config, name="tenant-7", dtype=torch.bfloat16)
    assert adapter.name == "tenant-7" and adapter.path == str(path) and adapter.rank == 4
    assert adapter.config["peft_type"] == "LORA"
    assert adapter.num_bytes == (path / "adapter_model.safetensors").stat().st_size
    m = adapter.modules[(0, "q_proj")]
    assert m.A.dtype == m.B.dtype == torch.bfloat16 and m.A.shape == (4, 64) and m.B.shape == (64, 4)
    assert m.scaling == 2.0
    assert load(path, model_config).name == "a"
    assert validate_peft_adapter(path, model_config, max_lora_rank=MAX_RANK) is None


def test_files_outside_a_directory(make_adapter, model_config, tmp_path):
    """The upload path: a parsed config dict and a safetensors file under any name."""
    path, peft_model = make_adapter(target_modules=["v_proj"])
    upload = tmp_path / "upload"
    upload.mkdir()
    shutil.copy(path / "adapter_model.safetensors", upload / "blob.bin")
    config = json.loads((path / "adapter_config.json").read_text())
    adapter = load_peft_files(config, upload / "blob.bin", model_config, max_lora_rank=MAX_RANK, name="up")
    assert_matches_peft(adapter, peft_model)
    assert adapter.name == "up"


def test_key_variants(make_adapter, model_config):
    path, peft_model = make_adapter(target_modules=["q_proj"])
    # transformers' integration writes no base_model.model. prefix; some tools keep the adapter name
    edit_tensors(
        path,
        lambda t: t.update(
            {
                k.removeprefix("base_model.model.")
                .replace("lora_A.", "lora_A.default.")
                .replace("lora_B.", "lora_B.default."): t.pop(k)
                for k in list(t)
            }
        ),
    )
    assert_matches_peft(load(path, model_config), peft_model)
    edit_tensors(
        path,
        lambda t: t.update(
            {
                "model.layers.0.self_attn.q_proj.lora_A.other.weight": t.pop(
                    "model.layers.0.self_attn.q_proj.lora_A.default.weight"
                )
            }
        ),
    )
    with pytest.raises(AdapterError, match="adapter-name segments"):
        load(path, model_config)


# --- refusals: adapter_config.json ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(use_dora=True), "use_dora"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(lora_bias=True), "lora_bias"),
        (dict(bias="all"), "bias"),
        (dict(bias="lora_only"), "bias"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    ],
)
def test_refuses_real_peft_features(kwargs, field, make_adapter, model_config):
    path, _ = make_adapter(**{"target_modules": ["q_proj"], **kwargs})
    with pytest.raises(AdapterError, match=field):
        load(path, model_config)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(peft_type="IA3"), "peft_type"),
        (dict(peft_type=None), "peft_type"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(init_lora_weights="pissa_niter_4"), "init_lora_weights"),
        (dict(init_lora_weights="olora"), "init_lora_weights"),
        (dict(trainable_token_indices=[1, 2]), "trainable_token_indices"),
        (dict(target_parameters=["mlp.experts.gate_up_proj"]), "target_parameters"),
        (dict(layer_replication=[[0, 2], [1, 4]]), "layer_replication"),
        (dict(alora_invocation_tokens=[5]), "alora_invocation_tokens"),
        (dict(use_qalora=True), "use_qalora"),
        (dict(r=0), "r = 0"),
        (dict(r=4.0), "r = 4.0"),
        (dict(lora_alpha="8"), "lora_alpha"),
        (dict(lora_alpha=1e308), r"lora_alpha = 1e\+308 with r = 4 .* beyond what fp32 holds"),
        (dict(alpha_pattern={"q_proj": -2e39}), r"alpha_pattern\['q_proj'\] = -2e\+39 .* beyond what fp32 holds"),
        (dict(r=8), r"rank is 4 but r = 8"),
        (dict(target_modules="*bad"), "target_modules"),
        (dict(target_modules=r".*q_proj", layers_to_transform=[0]), "layers_to_transform"),
        (dict(layers_pattern="layers"), "layers_pattern"),
        (dict(rank_pattern={"q_proj": 0}), "rank_pattern"),
        (dict(rank_pattern={"(?i)q_proj": 2}), "rank_pattern '\\(\\?i\\)q_proj' is not a valid regex"),
        (dict(layers_to_transform=[0], layers_pattern="(?P<idx>x)"), "layers_pattern"),
        (dict(target_modules=["q_proj", 3]), "target_modules must be null, a string or a list of strings"),
        (dict(alpha_pattern={"q_proj": None}), "alpha_pattern"),
        (dict(target_modules=["k_proj"]), "q_proj is not selected by adapter_config.json"),
        (dict(layers_to_transform=[7]), "select no projection"),
        (dict(target_modules=["q_proj"], exclude_modules=["q_proj"]), "select no projection"),
        (dict(target_modules=r"model\.layers\.0\.mlp"), "model.layers.0.mlp"),
    ],
)
def test_refuses_config(changes, match, make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj"])
    edit_config(path, **changes)
    with pytest.raises(AdapterError, match=match):
        load(path, model_config)


def test_task_type_is_irrelevant(make_adapter, model_config):
    path, peft_model = make_adapter(target_modules=["q_proj"])
    for task_type in (None, "SEQ_2_SEQ_LM", "whatever"):
        edit_config(path, task_type=task_type)
        assert_matches_peft(load(path, model_config), peft_model)


def test_refuses_rank_above_max(make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj", "v_proj"], r=4, rank_pattern={"v_proj": 32})
    with pytest.raises(AdapterError, match=r"r = 4 .*max_lora_rank = 2"):
        load(path, model_config, max_lora_rank=2)
    with pytest.raises(AdapterError, match=r"rank_pattern\['v_proj'\] = 32 .*max_lora_rank = 16"):
        load(path, model_config)


def test_overlapping_rank_pattern_follows_the_saved_order(make_adapter, model_config, make_llama):
    """Overlapping rank_pattern keys: the first key in the file that matches a module wins, as in PEFT's
    loader. PEFT before 0.22 sorted the keys on save, so 'layers.1...' came first and its rank 6 disagreed
    with the rank-2 tensors trained under 'q_proj': we refuse the file, and PEFT cannot reload it either.
    PEFT 0.22 keeps the order, so 'q_proj' still wins for layer 1 and both load the same ranks."""
    path, _ = make_adapter(
        target_modules=["q_proj"], rank_pattern={"q_proj": 2, "layers.1.self_attn.q_proj": 6}
    )
    saved = list(json.loads((path / "adapter_config.json").read_text())["rank_pattern"])
    if saved == ["layers.1.self_attn.q_proj", "q_proj"]:  # reordered by an older PEFT's save
        with pytest.raises(AdapterError, match=r"rank_pattern keys \['layers.1.self_attn.q_proj', 'q_proj'\]"):
            load(path, model_config)
        with pytest.raises(RuntimeError, match="size mismatch"):  # PEFT cannot reload it either
            peft.PeftModel.from_pretrained(make_llama(), path)
        return
    assert saved == ["q_proj", "layers.1.self_attn.q_proj"]
    adapter = load(path, model_config)
    assert_matches_peft(adapter, peft.PeftModel.from_pretrained(make_llama(), path))
    assert adapter.rank == 2


def test_refuses_missing_and_broken_files(make_adapter, model_config, tmp_path):
    with pytest.raises(AdapterError, match="not a directory"):
        load(tmp_path / "nope", model_config)
    path, _ = make_adapter(target_modules=["q_proj"])
    (path / "adapter_config.json").write_text("{'r': 4,")
    with pytest.raises(AdapterError, match="adapter_config.json is not valid JSON"):
        load(path, model_config)
    (path / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="adapter_config.json: expected a JSON object"):
        load(path, model_config)
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        load(path, model_config)

    path, _ = make_adapter("b", target_modules=["q_proj"])
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        load(path, model_config)


def test_refuses_pickle_without_loading_it(make_adapter, model_config, monkeypatch):
    path, _ = make_adapter(target_modules=["q_proj"], safe_serialization=False)
    assert (path / "adapter_model.bin").exists() and not (path / "adapter_model.safetensors").exists()
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(
        AdapterError, match="adapter_model.bin is a pickle.*convert it to adapter_model.safetensors"
    ):
        load(path, model_config)


# --- refusals: tensors -----------------------------------------------------------------------------


def test_refuses_other_base_model(make_adapter, model_config, make_model_config):
    path, _ = make_adapter(
        target_modules=["k_proj"],
        model_overrides=dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
    )
    with pytest.raises(
        AdapterError,
        match=r"layers\.0\.self_attn\.k_proj\.lora_A\.weight': shape \[4, 32\].*"
        r"expected \[r, H_in\] = \[4, 64\]",
    ):
        load(path, model_config)
    path, _ = make_adapter("deep", target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="layer 2 does not exist, the base model has 2 layers"):
        load(path, make_model_config(num_hidden_layers=2))
    path, _ = make_adapter("shallow", target_modules=["q_proj"], model_overrides=dict(num_hidden_layers=2))
    with pytest.raises(
        AdapterError, match="layers.2.self_attn.q_proj but .* no lora_A/lora_B for it .*fewer layers"
    ):
        load(path, model_config)


@pytest.mark.parametrize(
    "value, match", [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (-float("inf"), "NaN/Inf")]
)
def test_refuses_non_finite(value, match, make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj"])
    key = "base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"
    edit_tensors(path, lambda t: t[key].view(-1).__setitem__(5, value))
    with pytest.raises(AdapterError, match=f"{key}': 1 {match}"):
        load(path, model_config)


def test_refuses_float16_overflow(make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj"])
    edit_tensors(path, lambda t: t[f"{Q0}.lora_A.weight"].view(-1).__setitem__(0, 1e6))
    assert load(path, model_config).modules[(0, "q_proj")].A.view(-1)[0] == 1e6
    with pytest.raises(AdapterError, match=f"{Q0}.lora_A.weight': 1 value.* overflow torch.float16"):
        load(path, model_config, dtype=torch.float16)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda t: t.update({f"{Q0}.lora_C.weight": torch.zeros(4, 64)}),
            f"{Q0}.lora_C.weight' is not a LoRA weight",
        ),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "lm_head"),
        (
            lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 128)}),
            "embed_tokens",
        ),
        (lambda t: t.update({f"{Q0}.lora_B.bias": torch.zeros(64)}), "lora_bias"),
        (lambda t: t.update({f"{Q0}.lora_magnitude_vector": torch.zeros(64)}), "DoRA"),
        (
            lambda t: t.update(
                {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64)}
            ),
            "k_proj is not selected by adapter_config.json",
        ),
        (
            lambda t: t.update(
                {"base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": torch.zeros(64, 64)}
            ),
            "base_layer.weight' is not a LoRA weight",
        ),
        (lambda t: t.pop(f"{Q0}.lora_B.weight"), f"{Q0}.lora_A.weight' has no matching lora_B"),
        (lambda t: t.pop(f"{Q0}.lora_A.weight"), f"{Q0}.lora_B.weight' has no matching lora_A"),
        (
            lambda t: (t.pop(f"{Q0}.lora_A.weight"), t.pop(f"{Q0}.lora_B.weight")),
            "targets model.layers.0.self_attn.q_proj but adapter_model.safetensors has no lora_A/lora_B",
        ),
        (lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(4, 64, 1)}), r"shape \[4, 64, 1\]"),
    ],
)
def test_refuses_tensor_set(edit, match, make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj"])
    edit_tensors(path, edit)
    with pytest.raises(AdapterError, match=match):
        load(path, model_config)


# --- safetensors header ----------------------------------------------------------------------------

F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "header, data, match",
    [
        ({"__metadata__": {"format": "pt"}, "a": F32_2x2}, bytes(16), None),
        ({"a": {"dtype": "F16", "shape": [0], "data_offsets": [0, 0]}, "b": F32_2x2}, bytes(16), None),
        (b"\xff{}", b"", "not valid UTF-8 JSON"),
        (b"{not json", b"", "not valid UTF-8 JSON"),
        (b"[1]", b"", "JSON list, expected an object"),
        (b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": {}}', bytes(4), "duplicate"),
        ({"__metadata__": {"n": 1}}, b"", "__metadata__"),
        ({"a": {**F32_2x2, "dtype": "I64"}}, bytes(16), "'a': dtype 'I64'"),
        ({"a": {**F32_2x2, "dtype": "F64"}}, bytes(16), "'a': dtype 'F64'"),
        ({"a": {**F32_2x2, "shape": [2, -2]}}, bytes(16), "'a': shape"),
        ({"a": {**F32_2x2, "shape": [2, True]}}, bytes(16), "'a': shape"),
        ({"a": {**F32_2x2, "extra": 1}}, bytes(16), "exactly dtype, shape and data_offsets"),
        ({"a": {**F32_2x2, "data_offsets": [0]}}, bytes(16), "'a': data_offsets"),
        ({"a": F32_2x2}, bytes(12), r"outside the data section of 12 bytes \(truncated file\?\)"),
        ({"a": {**F32_2x2, "data_offsets": [0, 12]}}, bytes(12), "span 12 bytes but F32 shape .* needs 16"),
        ({"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}}, bytes(24), "overlap tensor 'a'"),
        ({"a": {**F32_2x2, "data_offsets": [4, 20]}}, bytes(20), "gap of 4 bytes"),
        ({"a": F32_2x2}, bytes(20), "4 bytes after the last tensor"),
    ],
)
def test_header(header, data, match, tmp_path):
    file = tmp_path / "x.safetensors"
    write_raw_safetensors(file, header, data)
    if match is None:
        tensors, _ = read_safetensors_header(file)
        assert tensors["b" if "b" in tensors else "a"].shape == (2, 2)
    else:
        with pytest.raises(AdapterError, match=f"x.safetensors: .*{match}"):
            read_safetensors_header(file)


def test_header_length_checked_before_reading(tmp_path):
    file = tmp_path / "x.safetensors"
    write_raw_safetensors(file, {}, header_len=2**63)
    with pytest.raises(AdapterError, match=r"declared header length 9223372036854775808 bytes exceeds"):
        read_safetensors_header(file)
    write_raw_safetensors(file, {}, header_len=150 * 2**20)
    with open(file, "r+b") as f:
        f.truncate(200 * 2**20)  # sparse: the file is large enough, the limit must still hold
    start = time.perf_counter()
    with pytest.raises(AdapterError, match=r"header length 157286400 bytes exceeds the limit"):
        read_safetensors_header(file)
    assert time.perf_counter() - start < 0.5
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(AdapterError, match="shorter than the 8-byte header length"):
        read_safetensors_header(tmp_path / "short.safetensors")


def test_broken_header_in_adapter_dir(make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj"])
    file = path / "adapter_model.safetensors"
    blob = file.read_bytes()
    file.write_bytes(blob[:-10])  # truncated download
    with pytest.raises(AdapterError, match="adapter_model.safetensors: tensor .* outside the data section"):
        load(path, model_config)
    file.write_bytes(blob[:8] + b"!" + blob[9:])
    with pytest.raises(AdapterError, match="adapter_model.safetensors: header is not valid UTF-8 JSON"):
        load(path, model_config)


def test_scaling_formulae(make_adapter, model_config):
    """Independent of PEFT's layer objects: alpha / r, alpha / sqrt(r) with rslora, per pattern."""
    path, _ = make_adapter(
        target_modules=["q_proj", "v_proj"],
        r=4,
        lora_alpha=8,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"v_proj": 3},
    )
    adapter = load(path, model_config)
    assert adapter.modules[(0, "q_proj")].scaling == 2.0 and adapter.modules[(0, "v_proj")].scaling == 1.5
    edit_config(path, use_rslora=True)
    adapter = load(path, model_config)
    assert adapter.modules[(0, "q_proj")].scaling == 4.0
    assert adapter.modules[(0, "v_proj")].scaling == 3 / math.sqrt(2)


def test_file_mixing_dtypes_loads_each_tensor(make_adapter, model_config):
    """One fp16 tensor among fp32 ones: the one-dtype fast checks do not apply, the tensors still load
    (the fp16 one widened) and a NaN in the fp16 one is still named."""
    path, peft_model = make_adapter(target_modules=["q_proj", "v_proj"])
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    edit_tensors(path, lambda t: t.update({key: t[key].half()}))
    got = load(path, model_config).modules[(1, "v_proj")].A
    assert got.dtype == torch.float32
    assert torch.equal(got, peft_lora_modules(peft_model)[(1, "v_proj")][2].half().float())
    edit_tensors(path, lambda t: t[key].view(-1).__setitem__(3, float("nan")))
    with pytest.raises(AdapterError, match=f"{key}': 1 NaN/Inf"):
        load(path, model_config)


def test_read_plan_reads_the_same_adapter_without_parsing(make_adapter, model_config):
    """A later load by the plan gives the same tensors, ranks, scalings and config as a full load, in
    each engine dtype; a file rewritten since (new identity) or holding values the dtype cannot hold
    gets None, so the caller goes through every check again."""
    from loraplex.adapters.peft import read_planned

    path, _ = make_adapter(target_modules="all-linear", lora_alpha=16)
    plan = load(path, model_config).plan
    assert plan is not None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        full, fast = load(path, model_config, dtype=dtype), read_planned(plan, "again", dtype)
        assert fast.name == "again" and (fast.path, fast.config, fast.rank) == (full.path, full.config, full.rank)
        assert set(fast.stacked) == set(full.stacked)
        for m, s in full.stacked.items():
            got = fast.stacked[m]
            assert torch.equal(got.A, s.A) and torch.equal(got.B, s.B) and got.A.dtype == dtype
            assert (got.ranks, got.scalings) == (s.ranks, s.scalings)
        assert fast.modules.keys() == full.modules.keys()

    key = f"{Q0}.lora_A.weight"
    time.sleep(0.01)  # a distinct mtime even on coarse clocks
    edit_tensors(path, lambda t: t[key].view(-1).__setitem__(0, 1e6))
    assert read_planned(plan, "again", torch.float32) is None  # not the file that was validated
    plan = load(path, model_config).plan
    assert read_planned(plan, "again", torch.float32).modules[(0, "q_proj")].A.view(-1)[0] == 1e6
    assert read_planned(plan, "again", torch.float16) is None  # 1e6 overflows float16: the full load says so

    time.sleep(0.01)
    config = edit_config(path, lora_alpha=64)  # the scaling changes: the plan must not keep the old one
    assert read_planned(plan, "again", torch.float32) is None
    assert load(path, model_config).modules[(0, "q_proj")].scaling == 64 / config["r"]


def test_file_replaced_after_its_header_was_checked_is_refused(make_adapter, model_config, monkeypatch):
    """The tensors are read from the file whose header was checked: one swapped in between (an atomic
    replace, same names and shapes, other values and order) is an error, not a mix of the two."""
    from safetensors.torch import load_file, save_file

    from loraplex.adapters import peft as peft_module

    path, _ = make_adapter(target_modules=["q_proj", "v_proj"])
    file = path / "adapter_model.safetensors"
    other = path.parent / "other.safetensors"
    save_file({k: t + 1 for k, t in reversed(load_file(file).items())}, other)
    check = peft_module.read_safetensors_header

    def check_then_replace(p):
        result = check(p)
        os.replace(other, file)
        return result

    monkeypatch.setattr(peft_module, "read_safetensors_header", check_then_replace)
    with pytest.raises(AdapterError, match="changed while it was read"):
        load(path, model_config)


def test_no_read_plan_for_per_layer_ranks(make_adapter, model_config):
    path, _ = make_adapter(target_modules=["q_proj", "v_proj"], rank_pattern={"layers.1.self_attn.q_proj": 2})
    assert load(path, model_config).plan is None
    path, _ = make_adapter("b", target_modules=["q_proj"], layers_to_transform=[1])
    assert load(path, model_config).plan is None
