"""Run one offline-generation workload through vLLM and print its throughput as JSON.

Run it with the peer environment's interpreter, not loraplex's (vLLM pins its own torch/transformers):

    /work/peers/vllm-venv/bin/python bench/peers/vllm_run.py MODEL_DIR WORKLOAD.json [--enable-lora ...]

WORKLOAD.json: {"prompts": [str, ...], "max_tokens": int, "ignore_eos": bool (default true),
"temperature": float (default 0), "adapters": [adapter dir or null per prompt] (optional)}.
Stdout carries exactly one line, the result as JSON; everything vLLM and its worker processes print
goes to stderr (vLLM logs to stdout by default, so the script points file descriptor 1 at stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("workload")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--omp-threads-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1 (vLLM's default 'auto' keeps one core for its frontend)")
    parser.add_argument("--reserved-cpus", type=int, default=None, help="VLLM_CPU_NUM_OF_RESERVED_CPU")
    parser.add_argument("--warmup-tokens", type=int, default=4, help="0 disables the untimed warm-up request")
    return parser.parse_args(argv)


def load_workload(path: str) -> dict:
    with open(path) as f:
        workload = json.load(f)
    prompts = workload.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise SystemExit(f"{path}: 'prompts' must be a non-empty list of non-empty strings")
    if not isinstance(workload.get("max_tokens"), int) or workload["max_tokens"] <= 0:
        raise SystemExit(f"{path}: 'max_tokens' must be a positive integer")
    adapters = workload.get("adapters")
    if adapters is not None and (not isinstance(adapters, list) or len(adapters) != len(prompts)):
        raise SystemExit(f"{path}: 'adapters' must list one adapter directory (or null) per prompt")
    return workload


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = load_workload(args.workload)
    result_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # inherited by vLLM's engine and worker processes too
    sys.stdout = sys.stderr
    # vLLM's CPU backend reads its KV budget from the environment at import time
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    if args.omp_threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_threads_bind
    if args.reserved_cpus is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)

    import vllm
    from vllm import LLM, SamplingParams

    adapters = workload.get("adapters") or [None] * len(workload["prompts"])
    if any(adapters) and not args.enable_lora:
        raise SystemExit("the workload names adapters: pass --enable-lora")

    start = time.perf_counter()
    llm_kwargs = dict(
        model=args.model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    if args.enable_lora:
        llm_kwargs.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - start

    lora_requests = None
    if args.enable_lora:
        from vllm.lora.request import LoRARequest

        ids: dict[str, int] = {}
        lora_requests = [
            None if a is None else LoRARequest(f"adapter-{ids.setdefault(a, len(ids) + 1)}", ids[a], a)
            for a in adapters
        ]

    if args.warmup_tokens > 0:
        llm.generate(
            [workload["prompts"][0]], SamplingParams(max_tokens=args.warmup_tokens, temperature=0.0),
            use_tqdm=False,
        )

    params = SamplingParams(
        max_tokens=workload["max_tokens"],
        temperature=float(workload.get("temperature", 0.0)),
        ignore_eos=bool(workload.get("ignore_eos", True)),
    )
    start = time.perf_counter()
    outputs = llm.generate(workload["prompts"], params, lora_request=lora_requests, use_tqdm=False)
    elapsed = time.perf_counter() - start

    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "elapsed_s": round(elapsed, 3),
        "tok_per_s": round(generated / elapsed, 2),
        "load_s": round(load_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "lora": bool(args.enable_lora),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "first_output": outputs[0].outputs[0].text[:200],
    }
    print(json.dumps(result), file=result_stream, flush=True)


if __name__ == "__main__":
    main()
