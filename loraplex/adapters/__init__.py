"""PEFT LoRA adapters: parsing and validation (`peft`), and the engine's adapter slots (`manager`)."""

from loraplex.adapters.peft import (
    AdapterError,
    LoRAAdapter,
    LoRAModule,
    StackedModule,
    load_peft_adapter,
    load_peft_files,
    read_adapter_config,
    validate_peft_adapter,
)

__all__ = [
    "AdapterError",
    "LoRAAdapter",
    "LoRAModule",
    "StackedModule",
    "load_peft_adapter",
    "load_peft_files",
    "read_adapter_config",
    "validate_peft_adapter",
]
