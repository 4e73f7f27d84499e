"""What a PEFT LoRA `adapter_config.json` means for a Llama-family base model.

The rules mirror PEFT 0.21.2 (`peft/tuners/tuners_utils.py::check_target_module_exists`,
`_maybe_include_all_linear_layers`, `inject_adapter`; `peft/utils/other.py::get_pattern_key`;
`peft/tuners/lora/model.py::_create_and_replace`; `peft/tuners/lora/layer.py::update_layer`), applied to
the base model's module names (`model.layers.3.self_attn.q_proj`), so that we target exactly the modules
that `PeftModel.from_pretrained` would wrap, with the same rank and scaling (one file, about 350 lines:
these rules are one specification and are checked against PEFT together):

- target_modules, list: a module is selected if its name equals an entry or ends with "." + entry.
  An exact full-name match skips the layers_to_transform filter, unless the list has >= 20 entries
  (PEFT then rewrites the list into minimal suffixes, and every match goes through the filter).
- target_modules, str: `re.fullmatch(target_modules, name)`; "all-linear" (any case): every Linear but
  lm_head, i.e. all seven projections. layers_to_transform / layers_pattern are refused with a str.
- target_modules null: PEFT's default for llama, mistral and qwen2: ["q_proj", "v_proj"].
- exclude_modules (checked first): str -> re.fullmatch; list -> exact name or "." + entry suffix.
- layers_to_transform (int or non-empty list): the layer index is the first `.<name>.<digits>.` in the
  module name, or the first `<layers_pattern>.<digits>.` when layers_pattern is given (a regex, or a
  list of them tried in order); no index found -> not selected.
- rank_pattern / alpha_pattern: the first key, in the file's order, with
  `re.match(rf"(.*\\.)?({key})$", name)` gives the module's r / lora_alpha; else r / lora_alpha.
  Note that PEFT's save_pretrained writes the JSON with sorted keys, so overlapping keys may resolve
  differently than during training; we follow the file, as PEFT's loader does.
- scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from loraplex.adapters.safetensors_check import AdapterError
from loraplex.model_config import LORA_TARGET_MODULES, ModelConfig

# PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for llama, mistral and qwen2.
DEFAULT_TARGET_MODULES = ["q_proj", "v_proj"]
FP32_MAX = 3.4028234663852886e38  # the largest finite float32 (torch.finfo(torch.float32).max)

# The regexes PEFT builds around a rank_pattern / alpha_pattern key and around a layers_pattern entry.
PATTERN_KEY_REGEX = r"(.*\.)?({})$"
LAYERS_PATTERN_REGEX = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."
# PEFT's MIN_TARGET_MODULES_FOR_OPTIMIZATION (see the module docstring).
MIN_TARGET_MODULES_FOR_OPTIMIZATION = 20
# init_lora_weights values after which the base weights themselves were changed during training; the
# adapter only fits the original base once converted (save_pretrained(path_initial_model_for_weight_conversion=...)),
# which rewrites init_lora_weights to true.
MUTATED_BASE_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# Fields that turn plain LoRA into something else when set (truthy): field -> what it is.
UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "fully trained copies of base modules",
    "lora_bias": "a trained bias on lora_B",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on raw parameters",
    "layer_replication": "replicated decoder layers",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "velora_config": "the VeLoRA variant",
    "monteclora_config": "the MonteCLoRA variant",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "the KaSA variant",
}


@dataclass(frozen=True)
class LoRAModuleSpec:
    """What the config says about one targeted projection: rank `r`, `lora_alpha` and `scaling`
    (the factor on B @ A). `r_source` names where r came from ("r" or "rank_pattern['q_proj']")."""

    r: int
    lora_alpha: float
    scaling: float
    r_source: str


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _show(value: object) -> str:
    """A config value as it reads in JSON (true, "all", [1, 2])."""
    return json.dumps(value, default=str)


def _compile(field: str, pattern: object, template: str = "{}") -> None:
    """Refuse `pattern` unless it is a string that compiles in the regex PEFT builds from it (`template`)."""
    if not isinstance(pattern, str):
        raise AdapterError(f"adapter_config.json: {field} must hold strings, got {pattern!r}")
    try:
        re.compile(template.format(pattern))
    except re.error as e:
        raise AdapterError(f"adapter_config.json: {field} {pattern!r} is not a valid regex: {e}") from None


def _str_or_str_list(config: dict, field: str) -> str | list[str] | None:
    value = config.get(field)
    if not (
        value is None
        or isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    ):
        raise AdapterError(
            f"adapter_config.json: {field} must be null, a string or a list of strings, got {value!r}"
        )
    return value


def _pattern_dict(config: dict, field: str, check_value, what: str) -> dict:
    value = config.get(field) or {}
    if not isinstance(value, dict):
        raise AdapterError(f"adapter_config.json: {field} must be an object, got {value!r}")
    for key, v in value.items():
        _compile(field, key, PATTERN_KEY_REGEX)
        if not check_value(v):
            raise AdapterError(f"adapter_config.json: {field}[{key!r}] = {v!r} is not {what}")
    return value


def check_lora_fields(config: dict) -> None:
    """Refuse what is not plain LoRA on nn.Linear (PEFT type, variants, biases, extra trained modules)."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(
            f"adapter_config.json: peft_type is {peft_type!r}; only 'LORA' adapters are served"
        )
    for field, what in UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise AdapterError(
                f"adapter_config.json: {field} = {_show(config[field])} is not supported: {what}"
            )
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f'adapter_config.json: bias = {_show(config["bias"])} trains base model biases; only "none" is supported'
        )
    if config.get("fan_in_fan_out"):
        raise AdapterError(
            "adapter_config.json: fan_in_fan_out = true describes transposed (Conv1D, GPT-2 style) weights; "
            "Llama projections are nn.Linear, so it must be false"
        )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(MUTATED_BASE_INITS):
        raise AdapterError(
            f"adapter_config.json: init_lora_weights = {init!r} changed the base weights during training; convert "
            "it with save_pretrained(path_initial_model_for_weight_conversion=...) first"
        )


def model_module_names(model_config: ModelConfig) -> list[str]:
    """`named_modules()` names of a Hugging Face Llama/Mistral/Qwen2 *ForCausalLM, root ("") included."""
    per_layer = [
        "",
        ".self_attn",
        *(f".self_attn.{m}" for m in LORA_TARGET_MODULES[:4]),
        ".mlp",
        *(f".mlp.{m}" for m in LORA_TARGET_MODULES[4:]),
        ".mlp.act_fn",
        ".input_layernorm",
        ".post_attention_layernorm",
    ]
    names = ["", "model", "model.embed_tokens", "model.layers"]
    for i in range(model_config.num_hidden_layers):
        names += [f"model.layers.{i}{suffix}" for suffix in per_layer]
    return names + ["model.norm", "model.rotary_emb", "lm_head"]


def _suffixes(name: str) -> list[str]:
    """Dot-separated suffixes of `name`, shortest first ("a.b.c" -> ["c", "b.c", "a.b.c"])."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts) - 1, -1, -1)]


def _minimal_target_modules(target_modules: set[str], all_names: list[str]) -> set[str]:
    """PEFT's rewrite of a long target_modules list (inject_adapter + _find_minimal_target_modules):
    for each entry, in sorted order of its suffix list, keep its shortest suffix that no untargeted module
    ends with, unless an already kept suffix covers it. The result selects the same modules by suffix."""
    ends = tuple("." + t for t in target_modules)
    others = [n for n in all_names if n not in target_modules and not n.endswith(ends)]
    taken = {suffix for name in others for suffix in _suffixes(name)}
    kept: set[str] = set()
    for item, suffixes in sorted(((t, _suffixes(t)) for t in target_modules), key=lambda kv: kv[1]):
        for suffix in suffixes:
            if suffix in kept or suffix in taken:
                continue
            if not any(item.endswith("." + k) for k in kept):
                kept.add(suffix)
                break
    return kept or set(target_modules)


@dataclass(frozen=True)
class _Targets:
    """The module-selection fields, type-checked and in the form PEFT's check_target_module_exists sees."""

    target_modules: str | set[str]
    exclude_modules: str | list[str] | None
    layers_to_transform: int | list[int] | None
    layers_pattern: list[str] | None

    def excluded(self, name: str) -> bool:
        ex = self.exclude_modules
        if not ex:
            return False
        if isinstance(ex, str):
            return re.fullmatch(ex, name) is not None
        return name in ex or any(name.endswith("." + e) for e in ex)

    def selects(self, name: str) -> bool:
        """Whether PEFT would wrap the module called `name` (e.g. `model.layers.3.self_attn.q_proj`)."""
        if self.excluded(name):
            return False
        tm = self.target_modules
        if isinstance(tm, str):
            return re.fullmatch(tm, name) is not None
        if name in tm:  # an exact name is taken as is, whatever layers_to_transform says
            return True
        if not any(name.endswith("." + t) for t in tm):
            return False
        if self.layers_to_transform is None or self.layers_to_transform == []:
            return True
        layer = self.layer_index(name)
        if layer is None:
            return False
        if isinstance(self.layers_to_transform, int):
            return layer == self.layers_to_transform
        return layer in self.layers_to_transform

    def layer_index(self, name: str) -> int | None:
        # Lazy `.*?`: the first numbered segment is the layer index.
        m = None
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        for pattern in self.layers_pattern or ():
            m = re.match(LAYERS_PATTERN_REGEX.format(pattern), name)
            if m is not None:
                break
        return int(m.group("idx")) if m else None


def _parse_targets(config: dict, all_names: list[str]) -> _Targets:
    target_modules = _str_or_str_list(config, "target_modules")
    exclude_modules = _str_or_str_list(config, "exclude_modules")
    layers_pattern = _str_or_str_list(config, "layers_pattern")
    layers = config.get("layers_to_transform")
    if not (
        layers is None or _is_int(layers) or (isinstance(layers, list) and all(_is_int(x) for x in layers))
    ):
        raise AdapterError(
            f"adapter_config.json: layers_to_transform must be an int or a list of ints, got {layers!r}"
        )
    if target_modules is None:
        target_modules = DEFAULT_TARGET_MODULES
    if isinstance(target_modules, str):
        # LoraConfig.__post_init__ refuses these combinations, so PEFT cannot load such an adapter.
        for field in ("layers_to_transform", "layers_pattern"):
            if config.get(field) is not None:
                raise AdapterError(
                    f"adapter_config.json: {field} cannot be used when target_modules is a string"
                )
        if target_modules.lower() == "all-linear":
            target_modules = list(LORA_TARGET_MODULES)
        else:
            _compile("target_modules", target_modules)
    if isinstance(target_modules, list):
        if "" in target_modules:
            raise AdapterError("adapter_config.json: target_modules contains an empty string")
        target_modules = set(target_modules)
        if len(target_modules) >= MIN_TARGET_MODULES_FOR_OPTIMIZATION:
            minimal = _minimal_target_modules(target_modules, all_names)
            if len(minimal) < len(target_modules):
                target_modules = minimal
    if isinstance(exclude_modules, str):
        _compile("exclude_modules", exclude_modules)
    if layers_pattern and layers is None:
        raise AdapterError("adapter_config.json: layers_pattern is set but layers_to_transform is not")
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern] if layers_pattern else []
    for pattern in layers_pattern or ():
        _compile("layers_pattern", pattern, LAYERS_PATTERN_REGEX)
    return _Targets(target_modules, exclude_modules, layers, layers_pattern)


def matching_pattern_keys(pattern_keys, name: str) -> list[str]:
    """The rank_pattern / alpha_pattern keys k, in order, with `re.match(rf"(.*\\.)?({k})$", name)`."""
    return [key for key in pattern_keys if re.match(PATTERN_KEY_REGEX.format(key), name)]


def pattern_key(pattern_keys, name: str) -> str | None:
    """The first matching key, which gives the module's value (PEFT's get_pattern_key), or None."""
    keys = matching_pattern_keys(pattern_keys, name)
    return keys[0] if keys else None


def resolve_lora_modules(
    config: dict, model_config: ModelConfig, *, max_lora_rank: int
) -> dict[tuple[int, str], LoRAModuleSpec]:
    """The projections the adapter targets, each with rank, alpha and scaling, per PEFT's rules.

    Keys are (layer index, module name in LORA_TARGET_MODULES). Raises AdapterError for unsupported
    fields (see check_lora_fields), malformed values, a selection that includes embed_tokens, lm_head
    or a non-Linear module, an empty selection, and a module rank above max_lora_rank.
    """
    check_lora_fields(config)
    all_names = model_module_names(model_config)
    targets = _parse_targets(config, all_names)
    for name in all_names:
        if name and not name.endswith(LORA_TARGET_MODULES) and targets.selects(name):
            kind = (
                "embeddings and lm_head are"
                if name in ("model.embed_tokens", "lm_head")
                else "only projections are"
            )
            raise AdapterError(
                f"adapter_config.json: target_modules selects {name!r}; {kind} not LoRA targets in loraplex"
            )

    r = config.get("r", 8)
    lora_alpha = config.get("lora_alpha", 8)
    if not _is_int(r) or r < 1:
        raise AdapterError(f"adapter_config.json: r = {r!r} is not a positive integer")
    if not _is_number(lora_alpha):
        raise AdapterError(f"adapter_config.json: lora_alpha = {lora_alpha!r} is not a finite number")
    rank_pattern = _pattern_dict(
        config, "rank_pattern", lambda v: _is_int(v) and v >= 1, "a positive integer"
    )
    alpha_pattern = _pattern_dict(config, "alpha_pattern", _is_number, "a finite number")
    use_rslora = bool(config.get("use_rslora", False))

    specs = {}
    for layer in range(model_config.num_hidden_layers):
        for module in LORA_TARGET_MODULES:
            name = model_config.hf_module_name(layer, module)
            if not targets.selects(name):
                continue
            r_key, alpha_key = pattern_key(rank_pattern, name), pattern_key(alpha_pattern, name)
            module_r = r if r_key is None else rank_pattern[r_key]
            r_source = "r" if r_key is None else f"rank_pattern[{r_key!r}]"
            alpha = lora_alpha if alpha_key is None else alpha_pattern[alpha_key]
            if module_r > max_lora_rank:
                raise AdapterError(
                    f"adapter_config.json: {r_source} = {module_r} (module {name}) exceeds max_lora_rank = {max_lora_rank}"
                )
            scaling = alpha / math.sqrt(module_r) if use_rslora else alpha / module_r
            if abs(scaling) > FP32_MAX:  # an adapter slot holds it in fp32 (or narrower): it could never load
                alpha_source = "lora_alpha" if alpha_key is None else f"alpha_pattern[{alpha_key!r}]"
                raise AdapterError(
                    f"adapter_config.json: {alpha_source} = {alpha!r} with {r_source} = {module_r} (module {name}) "
                    f"gives the scaling {scaling:.3g}, beyond what fp32 holds ({FP32_MAX:.3g})"
                )
            specs[(layer, module)] = LoRAModuleSpec(module_r, alpha, scaling, r_source)
    if not specs:
        raise AdapterError(
            "adapter_config.json: target_modules / layers_to_transform / exclude_modules select no projection "
            f"of this {model_config.num_hidden_layers}-layer {model_config.model_type} model"
        )
    return specs
