"""The standard offline throughput workload, shared by `loraplex bench` and bench/bench_engine.py."""

from __future__ import annotations

import random
import time

WORDS = (
    "the a model serves many tenants with adapters one base batch cache block token request engine "
    "scheduler memory fast small large paged attention prefix decode prompt output quick brown fox "
    "jumps over lazy dog river mountain city music science history garden winter summer ocean"
).split()


def make_prompts(num_requests: int, seed: int = 0, min_words: int = 20, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
        for _ in range(num_requests)
    ]


def run_engine_benchmark(model: str, *, num_requests: int = 32, max_tokens: int = 64, seed: int = 0,
                         llm=None, prompts: list[str] | None = None, **engine_kwargs) -> dict:
    from loraplex.engine.llm import LLM
    from loraplex.engine.sampling_params import SamplingParams

    llm = llm or LLM(model, **engine_kwargs)
    prompts = prompts if prompts is not None else make_prompts(num_requests, seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Warm up with a long prompt too: the first large prefill pays for growing the allocator's heap.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(["warm up " * 30, "warm up"], warm, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "tokens_per_s": generated / seconds,
        "outputs": outputs,
        "llm": llm,
    }


def measure_matmul_peak(seconds: float = 3.0, size: int = 1024) -> dict[str, float]:
    """The machine's fp32 matmul peak in GFLOP/s: the best rate of square `size` products with the threads
    torch uses, sampled over a few seconds, for each way torch can run them, plus "peak", the best of them.

    Every way counts. `torch.mm` goes through MKL, which on AMD processors runs its AVX2 code even where the
    processor has AVX-512, so alone it can understate the peak by half; oneDNN (weights pre-packed) picks
    the widest instructions the processor has; loraplex's own GEMM (`linear_cpu`, where this machine
    builds it) is what the engine's projections run, and can beat both."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    ways = {"torch.mm (MKL)": lambda: torch.mm(a, b, out=out)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, size)
        torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        ways["oneDNN inner product"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # a torch build without oneDNN
        pass
    from loraplex.kernels import linear_cpu

    kernel = linear_cpu._kernel()
    if kernel is not None:
        panels = kernel.pack(b)
        ways["loraplex GEMM"] = lambda: kernel.linear(a, panels, size, None, linear_cpu.MIN_PARALLEL_COST)
    rates: dict[str, float] = {}
    for name, fn in ways.items():
        fn()
        best = 0.0
        deadline = time.perf_counter() + seconds / len(ways)
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(4):
                fn()
            best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start) / 1e9)
        rates[name] = best
    rates["peak"] = max(rates.values())
    return rates
