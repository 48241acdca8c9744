"""Reference GPT-2 in plain PyTorch, shared by tests/golden/make_gpt_golden.py and
bench/torch_cpu_step.py.

The model is a pure function of a dict of parameters that use the Hugging Face GPT-2
names (without the "transformer." prefix) and the Conv1D layout [in, out], so that
y = x @ W + b.  Nothing here depends on dtype: pass float64 tensors for the golden
oracle, float32 for the benchmark.

Architecture (pre-LN GPT-2):
    x = wte[idx] + wpe[0:T]
    for each block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte.T                       (tied head)
LayerNorm eps 1e-5; attention: c_attn C->3C split q,k,v, heads [B,T,nh,hs] -> [B,nh,T,hs],
causal softmax(q k^T / sqrt(hs)), merge heads, c_proj; MLP: c_fc C->4C, GELU (tanh
approximation), c_proj 4C->C.  No dropout.  Loss: mean cross entropy over targets != -1.
"""

import math

import torch
import torch.nn.functional as F

LN_EPS = 1e-5
IGNORE_INDEX = -1


def param_shapes(n_layer, n_embd, block_size, vocab_size):
    """Ordered list of (hf_name, shape).  The order is also the initialisation order."""
    C = n_embd
    out = [("wte.weight", (vocab_size, C)), ("wpe.weight", (block_size, C))]
    for i in range(n_layer):
        p = f"h.{i}."
        out += [
            (p + "ln_1.weight", (C,)),
            (p + "ln_1.bias", (C,)),
            (p + "attn.c_attn.weight", (C, 3 * C)),
            (p + "attn.c_attn.bias", (3 * C,)),
            (p + "attn.c_proj.weight", (C, C)),
            (p + "attn.c_proj.bias", (C,)),
            (p + "ln_2.weight", (C,)),
            (p + "ln_2.bias", (C,)),
            (p + "mlp.c_fc.weight", (C, 4 * C)),
            (p + "mlp.c_fc.bias", (4 * C,)),
            (p + "mlp.c_proj.weight", (4 * C, C)),
            (p + "mlp.c_proj.bias", (C,)),
        ]
    out += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return out


def init_params(n_layer, n_embd, block_size, vocab_size, dtype=torch.float32):
    """Random init drawn from the global torch RNG in param_shapes() order.

    Matrices (wte, wpe, linear weights): N(0, 0.02^2).  LayerNorm weight: 1 + 0.1*randn,
    LayerNorm bias: 0.1*randn, linear biases: 0.02*randn.  Values are drawn in float32
    and then converted, so the f32 and f64 copies of a model hold the same numbers.
    """
    params = {}
    for name, shape in param_shapes(n_layer, n_embd, block_size, vocab_size):
        r = torch.randn(shape, dtype=torch.float32)
        if ".ln_" in name or name.startswith("ln_f"):
            t = 1.0 + 0.1 * r if name.endswith(".weight") else 0.1 * r
        else:
            t = 0.02 * r  # weights and linear biases alike
        params[name] = t.to(dtype)
    return params


# ---------------------------------------------------------------- primitives
def layer_norm(x, w, b, fused=False):
    if fused:
        return F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)  # biased variance
    return (x - mu) / torch.sqrt(var + LN_EPS) * w + b


def gelu_tanh(x, fused=False):
    if fused:
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def conv1d(x, w, b):
    """Hugging Face Conv1D: y = x @ W + b with W stored [in, out]."""
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def attention(x, p, pre, n_head, fused=False):
    B, T, C = x.shape
    hs = C // n_head
    qkv = conv1d(x, p[pre + "attn.c_attn.weight"], p[pre + "attn.c_attn.bias"])
    q, k, v = qkv.split(C, dim=-1)
    q = q.view(B, T, n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
    k = k.view(B, T, n_head, hs).transpose(1, 2)
    v = v.view(B, T, n_head, hs).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # [B, nh, T, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    att = att.masked_fill(~mask, float("-inf"))
    att = torch.softmax(att, dim=-1)
    y = att @ v  # [B, nh, T, hs]
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return conv1d(y, p[pre + "attn.c_proj.weight"], p[pre + "attn.c_proj.bias"])


def mlp(x, p, pre, fused=False):
    h = conv1d(x, p[pre + "mlp.c_fc.weight"], p[pre + "mlp.c_fc.bias"])
    h = gelu_tanh(h, fused)
    return conv1d(h, p[pre + "mlp.c_proj.weight"], p[pre + "mlp.c_proj.bias"])


def forward(p, idx, n_layer, n_head, fused=False):
    """Return logits [B, T, V] for token ids idx [B, T] (int64)."""
    B, T = idx.shape
    wte = p["wte.weight"]
    x = wte[idx] + p["wpe.weight"][:T].unsqueeze(0)
    for i in range(n_layer):
        pre = f"h.{i}."
        x = x + attention(layer_norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], fused),
                          p, pre, n_head, fused)
        x = x + mlp(layer_norm(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], fused),
                    p, pre, fused)
    x = layer_norm(x, p["ln_f.weight"], p["ln_f.bias"], fused)
    return x @ wte.t()


def loss_fn(logits, targets, fused=False):
    """Mean cross entropy over positions whose target != -1."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    tgt = targets.reshape(-1)
    if fused:
        return F.cross_entropy(flat, tgt, ignore_index=IGNORE_INDEX)
    valid = tgt != IGNORE_INDEX
    logp = torch.log_softmax(flat[valid], dim=-1)
    nll = -logp.gather(1, tgt[valid].unsqueeze(1)).squeeze(1)
    return nll.sum() / valid.sum()


def make_adamw(params, lr, betas, eps, weight_decay):
    """AdamW with weight decay only on tensors with dim >= 2 (wte, wpe, linear weights)."""
    decay = [t for t in params.values() if t.dim() >= 2]
    no_decay = [t for t in params.values() if t.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
