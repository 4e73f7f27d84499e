"""Gateway settings, read from `LORAPLEX_*` environment variables (pydantic-settings).

Defaults serve the default model on 127.0.0.1:8000 with a SQLite file under `$LORAPLEX_HOME` and
in-process quota counters. Outside `environment="development"` a configured admin key must be a real
one (`lpx-` and at least 32 random bytes), never a placeholder copied from an example.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.engine.loader import DEFAULT_MODEL, loraplex_home

PLACEHOLDER_SECRETS = {"changethis", "changeme", "secret", "admin", "lpx-changethis", "lpx-admin"}


class QuotaDefaults(BaseSettings):
    """Quotas a new tenant starts with; None means unlimited. Admins change them per tenant."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_DEFAULT_", extra="ignore")

    rpm: int | None = Field(60, ge=0)
    tpm: int | None = Field(100_000, ge=0)
    max_concurrent_requests: int | None = Field(8, ge=0)
    token_budget: int | None = Field(None, ge=0)
    budget_period: Literal["day", "week", "month"] = "month"
    max_adapters: int | None = Field(10, ge=0)
    max_adapter_bytes: int | None = Field(1 << 30, ge=0)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    priority: int = 0
    min_priority: int = 0

    @model_validator(mode="after")
    def _default_priority_allowed(self) -> QuotaDefaults:
        if self.priority < self.min_priority:
            raise ValueError(f"LORAPLEX_DEFAULT_PRIORITY ({self.priority}) is more urgent than LORAPLEX_DEFAULT_MIN_PRIORITY "
                             f"({self.min_priority}): a tenant's default priority must be one its requests may ask for")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore", hide_input_in_errors=True)

    environment: Literal["development", "production"] = "production"
    home: Path = Field(default_factory=loraplex_home)
    host: str = "127.0.0.1"
    port: int = 8000

    # the engine
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept in host memory, LRU (None: no limit)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_memory: int | None = None
    num_threads: int | None = Field(None, ge=1)  # CPU threads (None: the CPUs this process may use)
    # the engine's waiting queue: past these a call is shed with 503 (None: one more batch of requests,
    # 32 steps of prefill; see EngineConfig), and past an estimated wait for a place in the batch
    max_num_waiting_seqs: int | None = Field(None, ge=1)
    max_num_waiting_tokens: int | None = Field(None, ge=1)
    max_queue_wait_s: float | None = Field(10.0, gt=0)
    # "fair": priority, then fair share across tenants (VTC); "fcfs": arrival order (engine.fair_share)
    scheduling_policy: Literal["fair", "fcfs"] = "fair"
    priority_aging_s: float | None = Field(10.0, gt=0)
    enable_prefix_caching: bool = True  # reuse full KV blocks across requests (engine.block_manager)
    prefix_cache_scope: Literal["tenant", "global"] = "tenant"  # "global": tenants share cached blocks too

    # what one API call may ask, checked before anything is queued (400 naming the field)
    max_n: int = Field(16, ge=1)
    max_sequences_per_request: int = Field(64, ge=1)  # n x prompts
    max_prompt_tokens_per_request: int = Field(65_536, ge=1)  # over the call's distinct prompts
    max_tokens_limit: int | None = Field(None, ge=1)  # the largest max_tokens (None: the context)
    max_request_bytes: int = Field(16 << 20, gt=0)  # JSON bodies of /v1/chat/completions and /v1/completions

    # storage
    database_url: str | None = None  # default: sqlite:///$LORAPLEX_HOME/loraplex.db
    redis_url: str | None = None  # unset: in-process quota counters (one gateway process)
    redis_timeout_s: float = 0.5
    quota_fail_mode: Literal["open", "closed"] = "open"  # Redis unreachable: local limits, or 503
    # a concurrency slot outlives the last renewal by its process (every third of it) by this: a process that
    # dies frees its calls' slots within it
    concurrency_lease_s: float = Field(60.0, ge=1.0)
    db_pool_size: int | None = Field(None, ge=1)  # None: sized for the gateway's worker threads (db.py)

    # scale-out (`--replicas`): a call stays on a replica holding its adapter unless that replica has this
    # many more requests ongoing than the least loaded one (scaleout/router.py)
    affinity_slack: int = Field(8, ge=0)
    # how long an ingress waits for a replica to accept a call before it tries another (3 tries, then 503
    # replica_unavailable), and for the next item of a running call's stream (the replica sends one at
    # least every quarter of it) before it ends the call with 503 replica_unavailable (scaleout/client.py)
    replica_accept_timeout_s: float = Field(10.0, gt=0)
    replica_stall_timeout_s: float = Field(30.0, gt=0)

    shutdown_grace_s: float = Field(25.0, ge=0)  # SIGTERM: running requests get this long to finish (serve.py)

    admin_key: SecretStr | None = None
    metrics_auth: bool = False  # GET /metrics takes an admin key (its series name tenants)
    max_upload_bytes: int = Field(512 << 20, gt=0)
    default_max_tokens: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _refuse_placeholder_admin_key(self) -> Settings:
        key = self.admin_key.get_secret_value() if self.admin_key is not None else None
        if key is None or self.environment == "development":
            return self
        from loraplex.platform.security import is_well_formed_key

        if key.lower() in PLACEHOLDER_SECRETS or not is_well_formed_key(key):
            raise ValueError(
                "LORAPLEX_ADMIN_KEY must be a generated key (lpx- followed by at least 32 random bytes, "
                "e.g. from `python -c 'from loraplex.platform.security import new_key; print(new_key())'`), "
                "or unset to have one generated on first start; placeholders are accepted only with "
                "LORAPLEX_ENVIRONMENT=development"
            )
        return self

    @property
    def model_id(self) -> str:
        """The base model's id in the OpenAI API."""
        return self.served_model_name or Path(self.model).name

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'loraplex.db'}"

    @property
    def adapters_dir(self) -> Path:
        return self.home / "adapters"

    def engine_kwargs(self) -> dict:
        kwargs = dict(dtype=self.dtype, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                      max_cpu_loras=self.max_cpu_loras, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                      max_num_waiting_seqs=self.max_num_waiting_seqs,
                      max_num_waiting_tokens=self.max_num_waiting_tokens, max_queue_wait_s=self.max_queue_wait_s,
                      scheduling_policy=self.scheduling_policy, priority_aging_s=self.priority_aging_s,
                      enable_prefix_caching=self.enable_prefix_caching, prefix_cache_scope=self.prefix_cache_scope)
        if self.kv_cache_memory is not None:
            kwargs["kv_cache_memory"] = self.kv_cache_memory
        if self.num_threads is not None:
            kwargs["num_threads"] = self.num_threads
        return kwargs
