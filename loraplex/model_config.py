"""The shape of a Llama-family decoder (gpt-fast style: a dataclass, no config system) and the names of
the projections LoRA may target. Below `engine/`, `adapters/` and `kernels/`: all three read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Projections that LoRA may target, in the order the model applies them. Embeddings and lm_head
# are never targets (refused by the adapter validator).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The same, grouped as the model's fused projections take them (one `lora_linear` call each, slices in
# this order): the slices of a group share the CPU shrink mirror (`LoRAWeights.empty_group`).
LORA_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))

# Rank rows per page of the adapter slot tier (S-LoRA's unified paging): an adapter of rank r takes
# ceil(r / 8) pages (rounded up to a power of two), not a whole max-rank slot. 8 is PEFT's default r
# and the smallest rank commonly trained; when it does not divide max_lora_rank a page is a whole slot.
LORA_PAGE_ROWS = 8


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder-only model (Llama, Mistral, Qwen2).

    Sizes are counts, `rope_theta` is the RoPE base, `max_model_len` the context length in tokens.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_model_len: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "llama"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict of the Llama family.

        Raises ValueError for architectures other than llama, mistral and qwen2, or for rope scaling
        variants that the forward does not implement.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r}: loraplex runs llama, mistral and qwen2")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r}: only default RoPE is implemented")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            max_model_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def lora_module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA-targetable projection; KeyError for other names."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]

    def hf_module_name(self, layer: int, module: str) -> str:
        """The module's name in a Hugging Face Llama (`model.layers.3.self_attn.q_proj`)."""
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return f"model.layers.{layer}.{block}.{module}"
