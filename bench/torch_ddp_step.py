"""PyTorch DistributedDataParallel over gloo: the CPU peer of `shardgrad train --strategy ddp`.

Run from the repository root (2 ranks, 1 thread each, on one machine):
    /usr/bin/python3 bench/torch_ddp_step.py [--world 2 --threads 1 --n-layer 4 --n-head 4
        --n-embd 256 --seq-len 128 --batch-size 8 --vocab-size 256 --steps 20 --warmup 3]

The model is tests/golden/gpt_ref.py's GPT-2 (torch's fused layer_norm / gelu / cross_entropy)
wrapped in an nn.Module; DDP with bucket_cap_mb=25 (PyTorch's default, as shardgrad's
--bucket-mb). The global batch of --batch-size rows is split evenly over the ranks; each rank's
loss is its rows' mean cross-entropy, DDP averages the gradients. One step = forward + loss +
backward (with the overlapped all-reduce) + clip_grad_norm_(1.0) + AdamW (lr 3e-4, betas
(0.9, 0.95), wd 0.1 on >=2-D) + zero_grad. Prints rank 0's median step time as one JSON line.
OMP_WAIT_POLICY=PASSIVE and the thread counts are set before torch is imported (busy-waiting
OpenMP threads otherwise steal the cores from the other rank).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_blas import blas_info, warn_if_reference  # noqa: E402


def worker(rank, args):
    import torch
    import torch.distributed as dist
    import gpt_ref

    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(args.seed)
            params = gpt_ref.init_params(args.n_layer, args.n_embd, args.seq_len, args.vocab_size)
            self.names = list(params.keys())
            self.p = torch.nn.ParameterList([torch.nn.Parameter(params[n]) for n in self.names])

        def forward(self, idx, targets):
            p = dict(zip(self.names, self.p))
            logits = gpt_ref.forward(p, idx, args.n_layer, args.n_head, fused=True)
            return gpt_ref.loss_fn(logits, targets, fused=True)

    model = GPT()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(args.seed)
    local = args.batch_size // args.world
    batches = []
    for _ in range(args.warmup + args.steps):
        tok = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        mine = tok[rank * local:(rank + 1) * local]
        batches.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    times = []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
    if rank == 0:
        med = statistics.median(times)
        blas = blas_info(torch)
        warn_if_reference(blas)
        print(json.dumps({"impl": "pytorch-ddp-gloo", "torch_version": torch.__version__, "blas": blas, "world": args.world,
                          "threads_per_rank": args.threads, "config": {k: getattr(args, k) for k in
                          ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "vocab_size")},
                          "median_step_ms": med * 1e3, "min_step_ms": min(times) * 1e3,
                          "tokens_per_s": args.batch_size * args.seq_len / med}))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    for k, v in (("world", 2), ("threads", 1), ("n-layer", 4), ("n-head", 4), ("n-embd", 256), ("seq-len", 128),
                 ("batch-size", 8), ("vocab-size", 256), ("steps", 20), ("warmup", 3), ("seed", 0), ("port", 29533)):
        ap.add_argument("--" + k, type=int, default=v)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(v, str(args.threads))
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
