"""Where a step's time goes: the engine benchmark's workload, with the prefill step and the decode steps
split into their parts.

Runs the workload once to warm up, then again under cProfile for a window of decode steps, and groups
the time by what the calls do: projections, LM head, attention, fused elementwise kernels, KV writes,
sampling, and everything else (the Python around the model: scheduler, step tensors, outputs).

    .venv/bin/python bench/profile_decode.py                    # SmolLM2-135M, 32 requests, 2 threads
    .venv/bin/python bench/profile_decode.py --steps 20 --threads 1
    .venv/bin/python bench/profile_decode.py --adapters 8   # bench_lora's 8 adapters, request i on i % 8
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# (part, substrings of cProfile function labels whose own time belongs to it)
PARTS = [
    # where the C++ decoder stack runs, the 30 layers are this one call and the parts below it hold only what
    # runs outside it (the LM head) or, without the stack, the layers' pieces one by one
    ("decoder layers in one C++ call (projections, attention, norms, LoRA)", ("decoder_stack",)),
    ("projections + LM head (packed GEMM / F.linear)", ("_linear_pointwise", "_nn.linear", "_mkl_linear", "_linear_cpu_v")),
    ("paged attention", ("paged_decode_attention", "scaled_dot_product_attention", "index_select")),
    ("norms, activation, rotary (fused)", ("fused_add_rms_norm_", "rms_norm", "silu_and_mul", "rotary_")),
    ("KV cache writes", ("index_copy_", "write_kv_")),
    ("sampling (argmax, softmax, top-k)", ("argmax", "softmax", "topk", "multinomial", "log_softmax")),
    ("LoRA shrink + expand (kernel)", ("lora_groups",)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="decode steps to profile, after 20 unprofiled ones")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--adapters", type=int, default=0,
                    help="PEFT adapters (bench_lora's ranks 8-64, all seven projections), request i on i %% N")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from loraplex.engine.benchmark import make_prompts
    from loraplex.engine.llm import LLM
    from loraplex.engine.sampling_params import SamplingParams

    loras = []
    if args.adapters:
        from loraplex.engine.model_loader import resolve_model_dir

        sys.path.insert(0, str(Path(__file__).parent))
        from bench_lora import make_adapters

        tmp = Path(tempfile.mkdtemp(prefix="loraplex-profile-"))
        paths = make_adapters(resolve_model_dir(args.model), tmp / "adapters", args.adapters)
        llm = LLM(args.model, max_loras=args.adapters, max_cpu_loras=args.adapters, max_num_seqs=64,
                  adapter_store=str(tmp / "store"), enable_prefix_caching=False, kv_cache_memory=256 << 20)
        loras = [llm.resolve_adapter(str(p)) for p in paths]
    else:
        llm = LLM(args.model, max_loras=0, kv_cache_memory=256 << 20, enable_prefix_caching=False)
    engine = llm.engine
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(["warm up " * 30, "warm up"], warm, use_tqdm=False)
    if loras:  # every adapter into its slot before the measured steps
        llm.generate(["warm up"] * len(loras), warm, adapter=loras, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(args.num_requests)):
        engine.add_request(f"r{i}", prompt, params, lora=loras[i % len(loras)] if loras else None)

    before = engine.prompt_tokens_total
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    prefill_tokens = engine.prompt_tokens_total - before
    plain = []
    for _ in range(20):
        start = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - start)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    profiled = (time.perf_counter() - start) / args.steps
    while engine.has_unfinished_requests():
        engine.step()

    stats = pstats.Stats(profiler).stats
    own: dict[str, float] = {name: 0.0 for name, _ in PARTS}
    total_own = 0.0
    for (filename, _line, func), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        label = f"{filename}:{func}"
        total_own += tottime
        for name, needles in PARTS:
            if any(n in label for n in needles):
                own[name] += tottime
                break
    print(f"{args.model}, {args.num_requests} requests, {args.adapters} adapters, {torch.get_num_threads()} threads")
    print(f"prefill step ({prefill_tokens} prompt tokens): {prefill * 1e3:.0f} ms")
    print(f"decode step: median {statistics.median(plain) * 1e3:.1f} ms unprofiled; "
          f"{profiled * 1e3:.1f} ms under the profiler ({args.steps} steps)\n")
    print("| part of a decode step | ms per step | share |\n|---|---:|---:|")
    per_step = total_own / args.steps
    for name, _ in PARTS:
        ms = own[name] / args.steps * 1e3
        print(f"| {name} | {ms:.1f} | {100 * ms / (per_step * 1e3):.0f}% |")
    rest = (total_own - sum(own.values())) / args.steps * 1e3
    print(f"| everything else (Python: scheduler, step tensors, layers' glue, outputs) | {rest:.1f} | "
          f"{100 * rest / (per_step * 1e3):.0f}% |")


if __name__ == "__main__":
    main()
