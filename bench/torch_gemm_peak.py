"""SGEMM peak of PyTorch's CPU BLAS at a thread count: the denominator for PyTorch's CPU MFU.

Run from the repository root:
    /usr/bin/python3 bench/torch_gemm_peak.py [--threads 2] [--reps 5]

Times torch.mm (float32, out= preallocated) on the shapes sg_bench_train_step uses for its own
Eigen peak (1024^3, 2048x3072x768, 2048x768x3072), best of --reps after one warm-up call each,
with the same thread environment as bench/torch_cpu_step.py.  Prints one JSON line.
"""

import argparse
import json
import os
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_blas import blas_info, warn_if_reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(a.threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    shapes = []
    for m, n, k in ((1024, 1024, 1024), (2048, 3072, 768), (2048, 768, 3072)):
        x = torch.randn(m, k, generator=g)
        w = torch.randn(k, n, generator=g)
        out = torch.empty(m, n)
        torch.mm(x, w, out=out)
        best = float("inf")
        for _ in range(a.reps):
            t0 = time.perf_counter()
            torch.mm(x, w, out=out)
            best = min(best, time.perf_counter() - t0)
        shapes.append({"M": m, "N": n, "K": k, "gflops": 2 * m * n * k / best / 1e9})
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY")}
    blas = blas_info(torch)
    warn_if_reference(blas)
    print(json.dumps({"impl": "pytorch", "torch_version": torch.__version__, "blas": blas, "threads": a.threads,
                      "env": env, "gemm_peak_gflops": max(s["gflops"] for s in shapes),
                      "gemm_peak_shapes": shapes}))


if __name__ == "__main__":
    main()
