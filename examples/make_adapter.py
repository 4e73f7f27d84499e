"""Make a real PEFT LoRA adapter for loraplex's default model, SmolLM2-135M-Instruct (CPU, ~1 minute).

    .venv/bin/python examples/make_adapter.py pirate            # teaches it to talk like a pirate
    .venv/bin/python examples/make_adapter.py noise --steps 0   # untrained random weights (tests)

Writes OUT/adapter_config.json and OUT/adapter_model.safetensors (PEFT's save_pretrained), ready for
`POST /v1/adapters`. The base weights come from loraplex's model cache ($LORAPLEX_HOME).
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex.engine.loader import DEFAULT_MODEL, resolve_model

PIRATE = [
    ("Say hello.", "Arr, ahoy matey! Welcome aboard me ship!"),
    ("What is the capital of France?", "Arr, that be Paris, matey, a fine port for a pirate!"),
    ("How are you?", "Arr, I be as happy as a pirate with a chest o' gold, matey!"),
    ("Tell me about the weather.", "Arr, the winds be fair and the seas be calm today, matey!"),
]


def make_adapter(out: str, steps: int = 40, seed: int = 0, rank: int = 8) -> None:
    torch.manual_seed(seed)
    base = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        task_type="CAUSAL_LM", init_lora_weights=steps > 0)  # untrained: random A and B
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    for step in range(steps):
        question, answer = PIRATE[step % len(PIRATE)]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + answer_ids])
        labels = torch.tensor([[-100] * len(prompt_ids) + answer_ids])  # learn the answer only
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    model.save_pretrained(out)
    print(f"adapter written to {out}/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory to write the adapter to")
    parser.add_argument("--steps", type=int, default=40, help="training steps (0: random, untrained)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    make_adapter(args.out, args.steps, args.seed, args.rank)


if __name__ == "__main__":
    main()
