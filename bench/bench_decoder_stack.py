"""Decode step time of the CPU decoder stack (one C++ call for a step's layers) against the module path, on a
random model made locally, so that variants without a checkpoint at hand (Qwen3's q/k norms, partial
rotary, Llama's biases) can be measured at a real model's shapes.

Both engines run in one process and step in turn, so background load falls on both alike.

    .venv/bin/python bench/bench_decoder_stack.py                          # Qwen3, SmolLM2-135M's shapes
    .venv/bin/python bench/bench_decoder_stack.py --arch phi3 --config partial_rotary_factor=0.5
    .venv/bin/python bench/bench_decoder_stack.py --arch llama --config attention_bias=true --adapters 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _config(pairs: list[str]) -> dict:
    return {k: json.loads(v) for k, v in (p.split("=", 1) for p in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3", help="make_tiny_model's arch: llama, qwen2, qwen3, phi3, mistral")
    ap.add_argument("--config", nargs="*", default=[], help="extra config values, key=json")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="measured decode steps per path, after 5 unmeasured")
    ap.add_argument("--adapters", type=int, default=0, help="rank-16 adapters on every projection, request i on i %% N")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="loraplex-stack-bench-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    from loraplex.engine.llm import LLM
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.kernels import ops_cpu
    from loraplex.testing import make_peft_adapter, make_tiny_model

    model_dir = make_tiny_model(
        tmp / "model", args.arch, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, **_config(args.config),
    )
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if args.arch == "phi3" else \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter_dirs = [make_peft_adapter(model_dir, tmp / f"a{i}", r=16, target_modules=targets, seed=i)
                    for i in range(args.adapters)]

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 10, ignore_eos=True)
    engines = {}
    for path, flag in (("decoder stack", "1"), ("modules", "0")):
        os.environ["LORAPLEX_CPU_DECODER_STACK"] = flag
        kwargs = dict(max_loras=0)
        if args.adapters:
            kwargs = dict(max_loras=args.adapters, max_cpu_loras=args.adapters, adapter_store=str(tmp / f"store-{flag}"))
        llm = LLM(str(model_dir), kv_cache_memory=256 << 20, enable_prefix_caching=False, max_num_seqs=64, **kwargs)
        assert (llm.engine.runner.model.model._stack is not None) == (flag == "1"), f"{path}: not the path asked for"
        loras = [llm.resolve_adapter(str(d)) for d in adapter_dirs]
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"r{i}", prompt, params, lora=loras[i % len(loras)] if loras else None)
        while llm.engine.scheduler.num_waiting:  # the prefills, then a few decodes (and chunks left) unmeasured
            llm.engine.step()
        for _ in range(5):
            llm.engine.step()
        engines[path] = llm.engine

    stack_calls = []
    real_stack = ops_cpu.decoder_stack
    ops_cpu.decoder_stack = lambda *a: stack_calls.append(a[0].shape[0]) or real_stack(*a)
    times: dict[str, list[float]] = {path: [] for path in engines}
    for _ in range(args.steps):
        for path, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[path].append(time.perf_counter() - start)

    # every measured step of the stack's engine was one call, of every sequence's row
    assert stack_calls == [args.num_requests] * args.steps, "the decoder stack did not take every measured step"
    shape = (f"{args.arch} {json.dumps(_config(args.config)) if args.config else ''} hidden {args.hidden}, "
             f"{args.layers} layers, heads {args.heads}/{args.kv_heads} x {args.head_dim}, "
             f"intermediate {args.intermediate}")
    print(f"{shape}; {args.num_requests} sequences, {args.adapters} adapters, {torch.get_num_threads()} threads")
    print("| path | decode step, median ms | min ms |\n|---|---:|---:|")
    for path, ts in times.items():
        print(f"| {path} | {statistics.median(ts) * 1e3:.1f} | {min(ts) * 1e3:.1f} |")
    med = statistics.median(times["modules"]) / statistics.median(times["decoder stack"])
    best = min(times["modules"]) / min(times["decoder stack"])
    print(f"module path / decoder stack: {med:.2f}x (medians), {best:.2f}x (minima)")


if __name__ == "__main__":
    main()
