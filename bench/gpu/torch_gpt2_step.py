"""GPT-2 124M training step in PyTorch on one GPU: the peer of `shardgrad train --model gpt2
--device cuda:0 --dtype bf16` in bench/RESULTS.md.

The model is written here from the GPT-2 description (pre-LN blocks, GELU-tanh MLP, learned
positions, tied head; vocabulary padded to 50304), trained the way the fast reference trainers
do: bf16 autocast over f32 weights, fused causal attention (scaled_dot_product_attention),
fused AdamW, optionally torch.compile. Random tokens: the step's cost does not depend on them.

  python3 bench/gpu/torch_gpt2_step.py [--batch-size 16] [--seq-len 1024] [--steps 30]
      [--warmup 10] [--compile 1] [--peak-tflops 989] [--json-out FILE]

Prints one JSON line: median step time, tokens/s, model TFLOP/s and MFU against --peak-tflops.
FLOPs per token: 6 N + 12 L T C (N: parameters without wpe, the head counted through wte),
the same formula shardgrad's bench uses.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L=12, C=768, H=12, V=50304, T=1024):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json-out", default="")
    a = ap.parse_args()

    torch.manual_seed(0)
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(T=a.seq_len).to(dev)
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    step_model = torch.compile(model) if a.compile else model
    B, T = a.batch_size, a.seq_len
    x = torch.randint(0, 50257, (B, T), device=dev)
    y = torch.randint(0, 50257, (B, T), device=dev)

    times = []
    for s in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flops_per_token = 6 * n_params + 12 * 12 * T * 768
    tps = B * T / med
    out = {
        "impl": "pytorch" + (" + torch.compile" if a.compile else " eager"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "batch_size": B,
        "seq_len": T,
        "params_no_wpe": n_params,
        "median_step_ms": med * 1e3,
        "tokens_per_s": tps,
        "model_tflops": tps * flops_per_token / 1e12,
        "mfu": tps * flops_per_token / (a.peak_tflops * 1e12),
        "last_loss": float(loss),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(out))
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
