"""The hook every LoRA-aware projection calls: which layers and modules, which slices, which tokens."""

from __future__ import annotations

import contextlib

import torch

from loraplex.engine.llm import LLM
from loraplex.engine.llm_engine import PAUSE_LOADS_MIN_TOKENS
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class RecordingStep:
    """Adds `scale` to the outputs of the tokens that use a slot, on down_proj only; records every call."""

    def __init__(self, token_slots, calls, scale):
        self.token_slots = token_slots
        self.calls = calls
        self.scale = scale

    def apply(self, layer_idx, module_names, x, y, output_slices):
        self.calls.append((layer_idx, module_names, tuple(output_slices), x.shape[0], y.shape[1]))
        if module_names == ("down_proj",):
            y[self.token_slots >= 0] += self.scale
        return y

    def apply_embedding(self, input_ids, x):
        self.calls.append(("embed_tokens", tuple(input_ids.shape), tuple(x.shape)))
        return x

    def apply_logits(self, rows, hidden, logits):
        self.calls.append(("lm_head", list(rows), tuple(hidden.shape), tuple(logits.shape)))
        return logits


class FakeAdapterSlots:
    def __init__(self, scale=0.5):
        self.calls = []
        self.steps = []
        self.scale = scale

    def ready(self, lora):
        return True

    def try_acquire(self, lora):
        return 3

    def release(self, key):
        pass

    def slot_of(self, key):
        return 3

    loading = False
    pauses = 0

    @contextlib.contextmanager
    def loads_paused(self):
        self.pauses += 1
        yield

    def wait_for_load(self, timeout):
        pass

    def build_step(self, token_slots):  # a list of slots (or a tensor), as LoraManager.build_step takes
        token_slots = torch.as_tensor(token_slots, dtype=torch.long)
        self.steps.append(token_slots.tolist())
        if bool((token_slots < 0).all()):
            return None
        return RecordingStep(token_slots, self.calls, self.scale)


def test_projections_call_the_step_state_with_layer_modules_and_slices(tiny_qwen2_dir):
    slots = FakeAdapterSlots()
    llm = LLM(str(tiny_qwen2_dir), num_kv_blocks=64, adapter_slots=slots)
    base = llm.generate(["Hello world", "The quick"], GREEDY, use_tqdm=False)
    assert slots.calls == []  # no adapter in the step: the hook is never entered
    lora = LoRARequest("a", "hash-a", "/nowhere")
    outs = llm.generate(["Hello world", "The quick"], GREEDY, adapter=[lora, None], use_tqdm=False)
    arch = llm.engine.arch
    n_a = len(llm.tokenizer.encode("Hello world"))
    n_b = len(llm.tokenizer.encode("The quick"))
    # the embedding hook sees every token of the step, the head's only the rows sampled (one per sequence)
    assert slots.calls[0] == ("embed_tokens", (n_a + n_b,), (n_a + n_b, arch.hidden_size))
    assert slots.calls[4 * arch.num_layers + 1] == ("lm_head", [n_a - 1, n_a + n_b - 1], (2, arch.hidden_size),
                                                    (2, arch.vocab_size))
    first_step = [c for c in slots.calls if c[0] not in ("embed_tokens", "lm_head")][: 4 * arch.num_layers]
    expected = []
    for layer in range(arch.num_layers):
        expected += [
            (layer, ("q_proj", "k_proj", "v_proj"), (arch.q_size, arch.kv_size, arch.kv_size)),
            (layer, ("o_proj",), (arch.hidden_size,)),
            (layer, ("gate_proj", "up_proj"), (arch.intermediate_size, arch.intermediate_size)),
            (layer, ("down_proj",), (arch.hidden_size,)),
        ]
    assert [c[:3] for c in first_step] == expected
    # the mapping marks exactly the adapter request's tokens
    assert all(sorted(step) == [-1, 3] for step in slots.steps[-5:])  # decodes: one token each
    prefill_step = next(s for s in slots.steps if len(s) == n_a + n_b)
    assert sorted(prefill_step) == [-1] * n_b + [3] * n_a
    assert outs[1].outputs[0].token_ids == base[1].outputs[0].token_ids  # base request unaffected
    assert outs[0].outputs[0].token_ids != base[0].outputs[0].token_ids


def test_without_adapter_support_a_named_adapter_is_refused(tiny_llama_dir):
    import pytest

    from loraplex.engine.errors import InvalidRequestError

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_loras=0)
    with pytest.raises(InvalidRequestError, match="adapter"):
        llm.generate("Hello", GREEDY, adapter=LoRARequest("a", "h", "/x"), use_tqdm=False)
    assert torch.is_tensor(llm.engine.runner.kv_cache)


def test_steps_share_the_cores_with_background_adapter_loads(tiny_qwen2_dir, monkeypatch):
    """While an adapter loads in the background, a small CPU step runs on one OpenMP thread fewer and a
    large one (a prefill of many tokens) pauses the loads and keeps every thread; once the loads are done,
    steps get all their threads back. The tokens do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        slots = FakeAdapterSlots()
        llm = LLM(str(tiny_qwen2_dir), device="cpu", num_kv_blocks=256, adapter_slots=slots,
                  enable_prefix_caching=False)
        seen = []
        run = llm.engine.runner.run

        def recording_run(batch):
            seen.append((slots.loading, sum(batch.num_new_tokens), torch.get_num_threads(), slots.pauses))
            return run(batch)

        monkeypatch.setattr(llm.engine.runner, "run", recording_run)
        long_prompt = {"prompt_token_ids": [(7 * i) % 90 + 5 for i in range(PAUSE_LOADS_MIN_TOKENS)]}
        quiet = llm.generate(["Hello world", long_prompt], GREEDY, use_tqdm=False)
        slots.loading = True
        busy = llm.generate(["Hello world", long_prompt], GREEDY, use_tqdm=False)
        slots.loading = False
        again = llm.generate(["Hello world", long_prompt], GREEDY, use_tqdm=False)

        small = [(loading, threads) for loading, tokens, threads, _ in seen if tokens < PAUSE_LOADS_MIN_TOKENS]
        large = [(loading, threads) for loading, tokens, threads, _ in seen if tokens >= PAUSE_LOADS_MIN_TOKENS]
        assert {threads for loading, threads in small if loading} == {1}
        assert {threads for loading, threads in small if not loading} == {2}
        assert {threads for _, threads in large} == {2} and len(large) == 3
        paused = [pauses for loading, tokens, _, pauses in seen if loading and tokens >= PAUSE_LOADS_MIN_TOKENS]
        assert paused == [1] and slots.pauses == 1  # the one large step while loading paused the loads
        for a, b, c in zip(quiet, busy, again, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    finally:
        torch.set_num_threads(previous)
