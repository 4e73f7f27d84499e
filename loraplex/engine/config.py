"""Model and engine configuration.

`ModelConfig` is the shape of a Llama-family decoder (gpt-fast style: a dataclass, no config system).
`EngineConfig` holds the engine's limits and checks itself in `__post_init__`.
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


@dataclass
class EngineConfig:
    """Limits of one engine.

    max_num_seqs: running requests in one step. max_num_batched_tokens: tokens (prefill chunks plus
    decodes) in one forward pass. kv_cache_memory: bytes for the paged KV cache; None takes
    `default_kv_cache_memory` (a quarter of the weights' size, at least 64 MiB). block_size: tokens per
    KV cache block. max_loras: adapter slots of max_lora_rank rank rows each (vLLM's `max_loras` memory:
    max_loras x max_lora_rank rank rows per projection), paged in `LORA_PAGE_ROWS`-row pages, so one step
    holds max_loras adapters of rank max_lora_rank, or up to max_loras x max_lora_rank / 8 of rank 8
    (when 8 divides max_lora_rank; otherwise a page is a whole slot).
    max_lora_rank: the largest rank `r` an adapter may have. max_cpu_loras: adapters kept in host memory
    (None: no limit).
    max_num_waiting_seqs / max_num_waiting_tokens: how many requests beyond the running batch's free
    places, and how many tokens still to be prefilled, the waiting queue takes from a server (`AsyncLLM`)
    before it sheds new ones with `EngineOverloadedError` (`Scheduler.has_room`); None derives them: one
    more batch of requests (max_num_seqs) and 32 steps of prefill (32 x max_num_batched_tokens).
    max_queue_wait_s: the server also sheds a call whose last request would wait longer than this for a
    place in the batch, estimated from the running requests' remaining tokens and the recent step time
    (None: no bound in time). An empty queue always takes a call, however large. The offline `LLM`
    queues everything it is given.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None
    block_size: int = 16
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests)
    max_num_waiting_seqs: int | None = None
    max_num_waiting_tokens: int | None = None
    max_queue_wait_s: float | None = 10.0
    static_batching: bool = False  # benchmark baseline: admit a new batch only when the last one is done
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}), or running requests can starve of decode tokens")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_waiting_seqs is None:
            self.max_num_waiting_seqs = self.max_num_seqs
        if self.max_num_waiting_tokens is None:
            self.max_num_waiting_tokens = 32 * self.max_num_batched_tokens
        for name in ("max_num_waiting_seqs", "max_num_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0 seconds or None, got {self.max_queue_wait_s}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
