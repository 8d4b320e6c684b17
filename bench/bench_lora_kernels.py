"""Multi-LoRA shrink/expand on a GPU: the Triton kernels against the torch path, with achieved bandwidth.

For each projection shape and batch below, both paths compute y += LoRA delta of every token's adapter
(mixed ranks 8/16/32/64, some rows on the base model), on the same random inputs; the Triton result is
checked against the torch path before it is timed. Times are CUDA-event medians over many repetitions
(`triton.testing.do_bench`), the per-step token grouping (`LoraBatch`) built once outside the timing, as
the engine does; the same call is also timed captured in a CUDA graph (GPU time without Python's launch
cost). Bandwidth counts the bytes the delta must move at least once (the LoRA rows of x, the A and B rows
of the active adapters up to each one's rank, the fp32 shrink buffer written and read, and y read and
written) over either time. The card's bandwidth is measured in the same run (a device-to-device copy of 2 GiB,
read plus write bytes) beside its data-sheet figure. The base projection (x @ W^T over all rows, cuBLAS)
is timed too: LoRA's share of a projection is what serving pays.

    python bench/bench_lora_kernels.py                  # bf16, every shape
    python bench/bench_lora_kernels.py --dtype float16 --out results.md
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from loraplex.kernels.lora import LoraBatch, LoraSlotWeights, add_lora_torch

# (model, projection, in_features, output slices)
SHAPES = [
    ("SmolLM2-135M", "qkv", 576, (576, 192, 192)),
    ("SmolLM2-135M", "down", 1536, (576,)),
    ("Llama-2-7B", "qkv", 4096, (4096, 4096, 4096)),
    ("Llama-2-7B", "gate_up", 4096, (11008, 11008)),
    ("Llama-2-7B", "down", 11008, (4096,)),
]
# (label, tokens, adapters in the batch, share of rows on the base model)
BATCHES = [
    ("decode 32 tok / 8 adapters", 32, 8, 0.0),
    ("decode 256 tok / 64 adapters", 256, 64, 0.1),
    ("decode 128 tok / 128 adapters (each row its own)", 128, 128, 0.0),
    ("prefill 4096 tok / 8 adapters", 4096, 8, 0.1),
]
RANKS = (8, 16, 32, 64)
DATASHEET_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


def measured_copy_tbps(device: str) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    from triton.testing import do_bench

    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() / (ms * 1e-3) / 1e12


def build_problem(in_f, out_slices, tokens, n_adapters, base_share, dtype, device, gen):
    num_slots = n_adapters
    w = LoraSlotWeights(num_slots, in_f, out_slices, max(RANKS), dtype=dtype, device=device)
    for slot in range(num_slots):
        r = RANKS[slot % len(RANKS)]
        pairs = [
            (torch.randn(r, in_f, generator=gen) / in_f**0.5, torch.randn(out, r, generator=gen) / r**0.5)
            for out in out_slices
        ]
        w.set_slot(slot, [(a.to(device, dtype), b.to(device, dtype)) for a, b in pairs])
    slots = torch.arange(tokens) % n_adapters
    slots = slots[torch.randperm(tokens, generator=gen)]
    n_base = int(tokens * base_share)
    slots[:n_base] = -1
    slots = slots[torch.randperm(tokens, generator=gen)].tolist()
    x = (torch.randn(tokens, in_f, generator=gen)).to(device, dtype)
    y = (torch.randn(tokens, sum(out_slices), generator=gen)).to(device, dtype)
    batch = LoraBatch.build(slots, device=device)
    return w, x, y, batch, slots


def min_bytes(w: LoraSlotWeights, batch: LoraBatch, dsize: int) -> int:
    n = batch.num_lora_tokens
    total = n * w.in_features * dsize  # x rows
    total += 2 * n * w.out_features * dsize  # y read + write
    for slot in batch.slot_ids:
        rt = w.rank_total(slot)
        total += rt * w.in_features * dsize  # A rows up to the rank
        total += sum(r * o for r, o in zip(w.ranks[slot], w.out_slices, strict=True)) * dsize  # B
    rows = sum(w.rank_total(s) * c for s, c in zip(batch.slot_ids, batch.counts, strict=True))
    total += 2 * rows * 4  # fp32 shrink buffer written and read
    return total


def measure_row(model, proj, label, in_f, out_slices, tokens, n_adapters, base_share, base_w, dtype, dsize,
                device, gen, copy_tbps):
    """One table row: (markdown row, Triton TB/s, failure message or None)."""
    from triton.testing import do_bench

    from loraplex.kernels.lora_triton import (
        add_lora_triton,
        auto_split_k,
        lora_expand_triton,
        lora_shrink_triton,
    )

    w, x, y, batch, _ = build_problem(in_f, out_slices, tokens, n_adapters, base_share, dtype, device, gen)
    ref = y.clone()
    add_lora_torch(ref, x, w, batch)
    got = y.clone()
    add_lora_triton(got, x, w, batch)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    if err > tol:
        return "", 0.0, f"{model} {proj} {label}: Triton differs from the torch path, max rel err {err:.3g}"
    yb = y.clone()
    split = auto_split_k(x, w, batch)
    t_torch = do_bench(lambda: add_lora_torch(yb, x, w, batch), warmup=10, rep=100)
    t_triton = do_bench(lambda: add_lora_triton(yb, x, w, batch), warmup=10, rep=100)
    t_split1 = do_bench(lambda: add_lora_triton(yb, x, w, batch, split_k=1), warmup=10, rep=100)
    t_base = do_bench(lambda: torch.nn.functional.linear(x, base_w), warmup=10, rep=100)
    # the shrink/expand split, for the reader of the table
    s = lora_shrink_triton(x, w, batch)
    t_shrink = do_bench(lambda: lora_shrink_triton(x, w, batch, split_k=split), warmup=10, rep=100)
    t_expand = do_bench(lambda: lora_expand_triton(yb, s, w, batch), warmup=10, rep=100)
    # GPU time alone: the same call captured in a CUDA graph and replayed (no Python launch cost)
    t_graph = graph_time(lambda: add_lora_triton(yb, x, w, batch))
    tbps = min_bytes(w, batch, dsize) / (t_triton * 1e-3) / 1e12
    graph_tbps = min_bytes(w, batch, dsize) / (t_graph * 1e-3) / 1e12
    sweep = sweep_configs(x, yb, s, w, batch, split) if SWEEP else ""
    row = (
        f"| {model} | {proj} | {label} | {t_base * 1e3:.1f} | {t_torch * 1e3:.1f} | "
        f"{t_triton * 1e3:.1f} (shrink {t_shrink * 1e3:.1f} + expand {t_expand * 1e3:.1f}; "
        f"split_k {split}, {t_split1 * 1e3:.1f} unsplit) | "
        f"{t_torch / t_triton:.1f}x | {tbps:.2f} | {t_graph * 1e3:.1f} | {graph_tbps:.2f} | "
        f"{100 * graph_tbps / copy_tbps:.0f}% | {100 * t_triton / t_base:.0f}% |{sweep}"
    )
    return row, graph_tbps, None


SWEEP = False
SHRINK_CONFIGS = [(16, 128, 4), (16, 64, 4), (32, 64, 4), (32, 128, 8), (64, 64, 4)]  # block_n, block_k, warps
EXPAND_CONFIGS = [(128, 16, 4), (64, 16, 4), (128, 16, 8), (256, 16, 8), (128, 32, 4), (64, 32, 4)]  # n, k, warps


def graph_time(fn) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=100)


def sweep_configs(x, y, s, w, batch, split) -> str:
    """Graph-replayed time of each tile configuration, shrink and expand apart; the best of each."""
    from loraplex.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    shrink = {}
    for bn, bk, nw in SHRINK_CONFIGS:
        shrink[(bn, bk, nw)] = graph_time(
            lambda bn=bn, bk=bk, nw=nw: lora_shrink_triton(x, w, batch, split_k=split, block_n=bn, block_k=bk,
                                                           num_warps=nw))
    expand = {}
    for bn, bk, nw in EXPAND_CONFIGS:
        expand[(bn, bk, nw)] = graph_time(
            lambda bn=bn, bk=bk, nw=nw: lora_expand_triton(y, s, w, batch, block_n=bn, block_k=bk, num_warps=nw))
    bs, be = min(shrink, key=shrink.get), min(expand, key=expand.get)
    d_s, d_e = shrink[SHRINK_CONFIGS[0]], expand[EXPAND_CONFIGS[0]]
    return (
        f" shrink {d_s * 1e3:.1f} -> best {bs} {shrink[bs] * 1e3:.1f}; "
        f"expand {d_e * 1e3:.1f} -> best {be} {expand[be] * 1e3:.1f} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    ap.add_argument("--quick", action="store_true", help="first two shapes and batches only")
    ap.add_argument("--sweep", action="store_true", help="also time a few tile configurations per row")
    args = ap.parse_args()
    global SWEEP
    SWEEP = args.sweep
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: this benchmark times GPU kernels (the CPU paths are timed by bench_lora.py)")
        return 2
    import triton

    dtype = getattr(torch, args.dtype)
    dsize = torch.empty((), dtype=dtype).element_size()
    name = torch.cuda.get_device_name()
    sheet = next((v for k, v in DATASHEET_TBPS.items() if k in name), None)
    copy_tbps = measured_copy_tbps(args.device)
    lines = [
        f"device: {name}; torch {torch.__version__}, triton {triton.__version__}; dtype {args.dtype}",
        f"device-to-device copy: {copy_tbps:.2f} TB/s measured"
        + (f" (data sheet {sheet} TB/s)" if sheet else ""),
        "",
        "| model | proj | batch | base GEMM us | torch path us | Triton us | Triton x torch | Triton TB/s "
        "| Triton in a CUDA graph us | graph TB/s | % of copy BW | LoRA / base |"
        + (" tile sweep (graph, us) |" if args.sweep else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if args.sweep else ""),
    ]
    print("\n".join(lines), flush=True)
    gen = torch.Generator().manual_seed(0)
    all_tbps: list[float] = []
    failures: list[str] = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    batches = BATCHES[:2] if args.quick else BATCHES
    for model, proj, in_f, out_slices in shapes:
        base_w = torch.randn(sum(out_slices), in_f, generator=gen).to(args.device, dtype) / in_f**0.5
        for label, tokens, n_adapters, base_share in batches:
            try:
                row, tbps, failure = measure_row(
                    model, proj, label, in_f, out_slices, tokens, n_adapters, base_share, base_w, dtype, dsize,
                    args.device, gen, copy_tbps,
                )
            except Exception as exc:  # one broken shape must not hide the others' numbers
                row, tbps, failure = "", 0.0, f"{model} {proj} {label}: {type(exc).__name__}: {exc}"[:500]
            if failure:
                failures.append(failure)
                print("MISMATCH " + failure, flush=True)
                continue
            all_tbps.append(tbps)
            lines.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    if all_tbps:
        med = statistics.median(all_tbps)
        lines.append(f"\nmedian Triton bandwidth over the rows (CUDA graph): {med:.2f} TB/s")
        print(lines[-1])
    for f in failures:
        lines.append(f"MISMATCH {f}")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
