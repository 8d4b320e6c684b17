"""What bounds a decode step's projections: SmolLM2-135M's 120 projections run once with 32 rows, every
weight distinct (read cold from memory, as in a real step), six ways, beside the machine's memory stream
rate (a sum over 400 MB) and its fp32 matmul peak (1024x1024x1024, the best of MKL and oneDNN). A way whose effective GB/s is far below
the stream rate while its GFLOP/s approaches the peak is bound by arithmetic, not by memory.

    .venv/bin/python bench/bench_decode_floor.py
"""

import argparse
import time

import torch
import torch.nn.functional as F
import torch.utils.mkldnn

from loraplex.engine.benchmark import measure_matmul_peak
from loraplex.kernels import linear_cpu

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (out, in)
LAYERS, ROWS, ITERS = 30, 32, 10


def _cpu_flags() -> str:
    from loraplex.kernels.cpp_build import processor_identity

    return processor_identity()


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    gbytes = sum(w.numel() * 4 for ws in weights for w in ws) / 1e9
    x = {k: torch.randn(ROWS, k) for k in (576, 1536)}
    onednn = []
    for ws in weights:
        row = []
        for w in ws:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=True).requires_grad_(False)
            lin.weight.copy_(w)
            row.append(torch.utils.mkldnn.MkldnnLinear(lin, torch.float))
        onednn.append(row)
    packed = [[torch.ops.mkl._mkl_reorder_linear_weight(w, ROWS) for w in ws] for ws in weights]
    prepacked = [[torch.ops.mkldnn._reorder_linear_weight(w, ROWS) for w in ws] for ws in weights]
    kernel = linear_cpu._kernel()  # loraplex's GEMM (AVX-512 or AVX2 with FMA), where this machine's build has it
    panels = [[kernel.pack(w) for w in ws] for ws in weights] if kernel is not None else None
    gflop = sum(2 * ROWS * w.numel() for ws in weights for w in ws) / 1e9
    transposed = [[w.t().contiguous() for w in ws] for ws in weights]

    def run_linear():
        for ws in weights:
            for w in ws:
                F.linear(x[w.shape[1]], w)

    def run_onednn():
        for ms in onednn:
            for m in ms:
                m(x[m.weight.shape[1]].to_mkldnn()).to_dense()

    def run_mkl_packed():
        for ws, ps in zip(weights, packed, strict=True):
            for w, p in zip(ws, ps, strict=True):
                torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, ROWS)

    def run_prepacked():
        for ws, ps in zip(weights, prepacked, strict=True):
            for w, p in zip(ws, ps, strict=True):
                torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")

    def run_panels():
        for ws, ps in zip(weights, panels, strict=True):
            for w, p in zip(ws, ps, strict=True):
                kernel.linear(x[w.shape[1]], p, w.shape[0], None, linear_cpu.MIN_PARALLEL_COST)

    def run_mm_transposed():
        for ws in transposed:
            for w in ws:
                torch.mm(x[w.shape[0]], w)

    stream = torch.randn(100_000_000)
    stream.sum()
    start = time.perf_counter()
    for _ in range(5):
        stream.sum()
    stream_gbs = 0.4 / ((time.perf_counter() - start) / 5)
    peak = measure_matmul_peak()["peak"]  # the same measure as bench_engine.py's roofline
    print(f"{LAYERS} layers, {ROWS} rows, {gbytes * 1000:.0f} MB of fp32 weights, {gflop:.1f} GFLOP, "
          f"{torch.get_num_threads()} threads")
    print(f"memory stream (sum over 400 MB): {stream_gbs:.1f} GB/s; fp32 matmul peak: {peak:.0f} GFLOP/s")
    print("| way | ms/step | effective GB/s | GFLOP/s | % of matmul peak |\n|---|---:|---:|---:|---:|")
    ways = [("F.linear", run_linear), ("oneDNN linear (MkldnnLinear)", run_onednn),
            ("oneDNN inner product, weights pre-packed (the engine without AVX-512 or AVX2)", run_prepacked),
            ("MKL packed GEMM", run_mkl_packed), ("torch.mm, pre-transposed", run_mm_transposed)]
    if panels is not None:
        width = 32 if "avx512f" in _cpu_flags() else 16
        ways.insert(0, (f"loraplex GEMM, {width}-column panels (the engine)", run_panels))
    for name, fn in ways:
        for _ in range(2):
            fn()
        start = time.perf_counter()
        for _ in range(ITERS):
            fn()
        ms = (time.perf_counter() - start) / ITERS * 1e3
        print(f"| {name} | {ms:.1f} | {gbytes / (ms / 1e3):.1f} | {gflop / (ms / 1e3):.0f} | "
              f"{100 * gflop / (ms / 1e3) / peak:.0f}% |")

if __name__ == "__main__":
    main()
