"""Tiny randomly initialised models and tokenizers, made locally, for tests and quick demos.

No model hub is needed: the tokenizer is a byte-level BPE trained on a few sentences, and the weights are
drawn from a seeded generator and saved as a Hugging Face directory (config, safetensors, tokenizer,
chat template, generation config).
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Many tenants fine-tune one base model with LoRA adapters and serve them together.",
    "A paged KV cache keeps fixed-size blocks of keys and values for every sequence.",
    "Continuous batching lets requests join and leave the batch at every step.",
    "Hello world! Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: , . ; ? ( ) [ ] { } - + = / * & % $ # @ !",
    "Grüße aus München, 東京, مرحبا, emoji 🙂 and more unicode text.",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer and save it as a fast HF tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    vocab_size: int = 384,
    **config_kwargs,
) -> Path:
    """Create a tiny random model directory. arch: "llama", "qwen2", "qwen3", "phi3", "mistral" or "tied" (llama,
    tied embeddings like SmolLM2). Qwen3 gets head_dim 32 unless given (its heads are wider than
    hidden_size / heads, as in Qwen3-0.6B). Extra keyword arguments go to the transformers config
    (attention_bias, sliding_window, head_dim, rope_scaling, partial_rotary_factor, ...). Returns the
    directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out, vocab_size=vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
    )
    sliding_window = config_kwargs.pop("sliding_window", None)
    common.update(config_kwargs)
    if arch in ("llama", "tied"):
        from transformers import LlamaConfig

        config = LlamaConfig(
            **common,
            rope_theta=10000.0,
            tie_word_embeddings=(arch == "tied") if tie_word_embeddings is None else tie_word_embeddings,
        )
    elif arch == "qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(
            **common, rope_theta=1000000.0, tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window,
        )
    elif arch == "qwen3":
        from transformers import Qwen3Config

        common.setdefault("head_dim", 32)
        config = Qwen3Config(
            **common, rope_theta=1000000.0, tie_word_embeddings=bool(tie_word_embeddings),
            sliding_window=sliding_window,
        )
    elif arch == "phi3":
        from transformers import Phi3Config

        config = Phi3Config(
            **common, rope_theta=10000.0, sliding_window=sliding_window,
            tie_word_embeddings=bool(tie_word_embeddings),
        )
    elif arch == "mistral":
        from transformers import MistralConfig

        config = MistralConfig(
            **common, rope_theta=10000.0, sliding_window=sliding_window,
            tie_word_embeddings=bool(tie_word_embeddings),
        )
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 makes near-uniform logits and ties in greedy decoding; a larger spread
    # gives decisive argmaxes so token-for-token comparisons are meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(str(out))
    (out / "loraplex_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return out


def make_peft_adapter(
    base_model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    target_modules: tuple[str, ...] | list[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    lora_alpha: float | None = None,
    seed: int = 0,
    init_scale: float = 0.1,
    **lora_config_kwargs,
) -> Path:
    """Train-free PEFT LoRA adapter for a model made by make_tiny_model (or any HF causal LM directory).

    Uses real peft (LoraConfig + get_peft_model + save_pretrained with safetensors). PEFT initialises B (an
    embedding's lora_embedding_A) to zero, which would make the adapter a no-op; it is redrawn from
    N(0, init_scale) so the adapter changes the model's outputs. lora_alpha defaults to 2 * r. Extra keyword arguments go to LoraConfig
    (rank_pattern, alpha_pattern, layers_to_transform, ...). Returns the adapter directory.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        **lora_config_kwargs,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            # PEFT zeroes lora_B of a linear layer and lora_embedding_A of an embedding
            if "lora_B" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * init_scale)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


class Untokenizable:
    """A tokenizer backend stand-in that fails any tokenizing call and passes everything else through: put in
    place of a Tokenizer's backend, it shows that a path refuses a prompt without tokenizing it."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        if name in ("encode", "encode_batch"):
            raise AssertionError("the prompt was tokenized")
        return getattr(self._backend, name)
