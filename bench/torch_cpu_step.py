"""PyTorch (eager, CPU, float32) peer for the shardgrad CPU training-step benchmark.

Run from the repository root:
    /usr/bin/python3 bench/torch_cpu_step.py [--n-layer 4 --n-head 4 --n-embd 256
        --seq-len 128 --batch-size 8 --vocab-size 256 --threads 2 --steps 20 --warmup 3
        --seed 0] [--json-out FILE]

Model: the GPT-2 of tests/golden/gpt_ref.py (same code as the golden oracle, using torch's
fused layer_norm / gelu(tanh) / cross_entropy), block_size = seq_len, float32.
One step = forward + loss + backward + clip_grad_norm_(1.0) + AdamW step (lr 3e-4,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on dim>=2 tensors) + zero_grad.
Each step uses a fresh random batch of B x (T+1) tokens from a torch.Generator seeded with
--seed (idx = tokens[:, :-1], targets = tokens[:, 1:]); batches are pre-generated so
timing covers only the step.  The first --warmup steps are not timed; each of the next
--steps steps is timed with time.perf_counter.

Prints one JSON line (also written to --json-out if given).  FLOP model:
    N = non-embedding parameters (all h.* tensors + ln_f) + V*C (wte, counted because the
        tied LM head is a [B*T, C] x [C, V] GEMM; wpe is a lookup and is not counted)
    model_flops_per_step = 6 * N * B * T  +  12 * n_layer * B * T^2 * C
The second term is attention scores: q k^T and att @ v are each 2*T*T*C flops per sequence
per layer in the forward pass, x3 for forward + backward, with no discount for the causal
mask.  gflops = model_flops_per_step / median step time / 1e9;
tokens_per_s = B*T / median step time.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.dont_write_bytecode = True  # keep tests/golden free of __pycache__
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "golden"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_blas import blas_info, warn_if_reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    if a.n_embd % a.n_head:
        ap.error("--n-embd must be divisible by --n-head")
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    # Thread settings must be in the environment before torch is imported.  Debian's torch
    # runs its own ops on an OpenMP pool but its GEMMs on OpenBLAS's pthread pool; with
    # libgomp's default spin-waiting the idle OpenMP workers steal the cores OpenBLAS needs
    # (measured ~3x slower steps on 2 cores), so the OpenMP pool waits passively unless the
    # caller says otherwise.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(a.threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                      "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
           if k in os.environ}
    import torch
    import gpt_ref

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    L, H, C, T, B, V = a.n_layer, a.n_head, a.n_embd, a.seq_len, a.batch_size, a.vocab_size
    params = {k: v.requires_grad_(True)
              for k, v in gpt_ref.init_params(L, C, T, V, dtype=torch.float32).items()}
    plist = list(params.values())
    opt = gpt_ref.make_adamw(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    gen = torch.Generator().manual_seed(a.seed)
    total = a.warmup + a.steps
    batches = [torch.randint(0, V, (B, T + 1), generator=gen, dtype=torch.int64)
               for _ in range(total)]

    times, losses = [], []
    for s in range(total):
        tok = batches[s]
        idx, tgt = tok[:, :-1], tok[:, 1:].contiguous()
        t0 = time.perf_counter()
        logits = gpt_ref.forward(params, idx, L, H, fused=True)
        loss = gpt_ref.loss_fn(logits, tgt, fused=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if s >= a.warmup:
            times.append(t1 - t0)
            losses.append(loss.item())  # outside the timed region

    n_total = sum(p.numel() for p in plist)
    n_flop = n_total - params["wpe.weight"].numel()  # non-embedding + wte (tied head)
    flops = 6 * n_flop * B * T + 12 * L * B * T * T * C
    med = statistics.median(times)
    out = {
        "impl": "pytorch-eager",
        "torch_version": torch.__version__,
        "blas": blas_info(torch),
        "threads": torch.get_num_threads(),
        "env": env,
        "config": {"n_layer": L, "n_head": H, "n_embd": C, "seq_len": T, "batch_size": B,
                   "vocab_size": V, "steps": a.steps, "warmup": a.warmup, "seed": a.seed,
                   "dtype": "float32", "lr": 3e-4, "weight_decay": 0.1, "clip": 1.0},
        "n_params": n_total,
        "n_params_flops": n_flop,
        "median_step_ms": med * 1e3,
        "min_step_ms": min(times) * 1e3,
        "mean_step_ms": statistics.fmean(times) * 1e3,
        "tokens_per_s": B * T / med,
        "model_flops_per_step": flops,
        "flops_formula": "6*N*B*T + 12*n_layer*B*T*T*C, N = params - wpe",
        "gflops": flops / med / 1e9,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    warn_if_reference(out["blas"])
    line = json.dumps(out)
    print(line)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
