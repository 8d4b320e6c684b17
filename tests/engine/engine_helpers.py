"""Shared helpers for the engine tests: reference generation with Hugging Face transformers."""

from __future__ import annotations

import torch

PROMPTS = [
    "The quick brown fox",
    "Hello world! Numbers 0 1 2",
    "A paged KV cache keeps fixed-size blocks of keys and values for every sequence.",
    "Grüße aus München",
]


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, hf_model=None) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = hf_model or AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def peft_greedy(model_dir, adapter_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' (with PEFT's adapter where `adapter_dir` is given) greedy tokens for each prompt, one full
    forward pass per token, no cache and no padding: the reference the LoRA parity tests compare with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs


def mixed_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """`count` token-id prompts of assorted lengths (1 to ~70 tokens), some sharing a long prefix."""
    import random

    rng = random.Random(seed)
    base = tokenizer.encode(" ".join(PROMPTS))
    prompts = []
    for i in range(count):
        length = rng.randint(1, len(base))
        if i % 3 == 0:
            prompts.append(base[:length])  # shares a prefix with the others
        else:
            prompts.append([rng.randrange(3, tokenizer.vocab_size) for _ in range(length)])
    return prompts
