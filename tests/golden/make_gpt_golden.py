"""Generate tests/golden/gpt_tiny.safetensors, the PyTorch oracle for the C++ GPT-2 golden test.

Run from the repository root (deterministic; rewrites the file byte for byte):
    /usr/bin/python3 tests/golden/make_gpt_golden.py
Needs only Debian's python3-torch (1.13, CPU) and numpy; the safetensors file is written
by hand (no safetensors package).  Model code lives in tests/golden/gpt_ref.py.

Config: n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=61 (not a multiple of 8),
batch B=2, sequence T=12.  torch.manual_seed(1234), then weights are drawn in the order of
gpt_ref.param_shapes (matrices and linear biases 0.02*randn, LayerNorm weight 1+0.1*randn,
LayerNorm bias 0.1*randn), then idx, targets, and the 3 ignored positions.

All references are computed in float64 from the float32 weights (upcast) and stored as F32.
Tensors in the file (V=61, C=32, S=16, B=2, T=12; <name> = each Hugging Face GPT-2 name,
Conv1D layout [in, out], no "transformer." prefix):
    <name>                     F32  initial weights (26 tensors)
    input.idx                  I64  [B, T]       tokens in [0, V)
    input.targets              I64  [B, T]       tokens in [0, V), exactly 3 entries are -1
    expected.logits            F32  [B, T, V]
    expected.loss              F32  [1]          mean CE over targets != -1
    grad.<name>                F32  d loss / d <name> (wte: embedding + tied head)
    adamw.losses               F32  [3]          loss before each of the 3 AdamW steps
    adamw.grad_norms           F32  [3]          global grad L2 norm before clipping
    after_adamw.<name>         F32  weights after 3 steps of: loss, backward,
                                    clip_grad_norm_(1.0), AdamW(lr=1e-2, betas=(0.9, 0.95),
                                    eps=1e-8, weight_decay=0.1 on dim>=2 tensors, 0 on others)
__metadata__ (all strings): n_layer, n_head, n_embd, block_size, vocab_size, batch_size,
seq_len, lr, beta1, beta2, eps, weight_decay, clip, steps, seed, ignore_index, ln_eps,
compute_dtype.
"""

import json
import os
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True  # keep tests/golden free of __pycache__
sys.path.insert(0, HERE)
import gpt_ref  # noqa: E402

CFG = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=61,
           batch_size=2, seq_len=12)
OPT = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, steps=3)
SEED = 1234
OUT_PATH = os.path.join(HERE, "gpt_tiny.safetensors")

_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<i8"): "I64",
           np.dtype("<i4"): "I32"}


def write_safetensors(path, tensors, metadata):
    """tensors: ordered dict name -> numpy array.  Data laid out in insertion order."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        raw = arr.tobytes()
        header[name] = {"dtype": _DTYPES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((-len(hjson)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path):
    """Independent minimal reader used to check the writer."""
    np_types = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4"}
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    assert n % 8 == 0
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = buf[8 + n:]
    out, ends = {}, []
    for name, info in header.items():
        b, e = info["data_offsets"]
        dt = np.dtype(np_types[info["dtype"]])
        assert e - b == dt.itemsize * int(np.prod(info["shape"], dtype=np.int64))
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(info["shape"])
        ends.append((b, e))
    ends.sort()
    assert ends[0][0] == 0 and ends[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))  # contiguous, no holes
    return out, meta


def main():
    torch.manual_seed(SEED)
    L, H, C = CFG["n_layer"], CFG["n_head"], CFG["n_embd"]
    S, V, B, T = CFG["block_size"], CFG["vocab_size"], CFG["batch_size"], CFG["seq_len"]

    w32 = gpt_ref.init_params(L, C, S, V, dtype=torch.float32)
    idx = torch.randint(0, V, (B, T), dtype=torch.int64)
    targets = torch.randint(0, V, (B, T), dtype=torch.int64)
    ignored = torch.randperm(B * T)[:3]
    targets.view(-1)[ignored] = gpt_ref.IGNORE_INDEX
    assert int((targets == -1).sum()) == 3

    def fresh_f64():
        return {k: v.to(torch.float64).clone().requires_grad_(True) for k, v in w32.items()}

    # ---- forward / loss / gradients in float64
    p = fresh_f64()
    logits = gpt_ref.forward(p, idx, L, H)
    loss = gpt_ref.loss_fn(logits, targets)
    loss.backward()
    ref_ce = torch.nn.functional.cross_entropy(logits.detach().reshape(-1, V),
                                               targets.reshape(-1), ignore_index=-1)
    assert abs(loss.item() - ref_ce.item()) < 1e-12, (loss.item(), ref_ce.item())
    # cross-check the hand-written LayerNorm / GELU / CE against torch's fused ones
    with torch.no_grad():
        lf = gpt_ref.forward(p, idx, L, H, fused=True)
        assert (lf - logits).abs().max().item() < 1e-12
        assert abs(gpt_ref.loss_fn(lf, targets, fused=True).item() - loss.item()) < 1e-12
    grads = {k: v.grad.detach().clone() for k, v in p.items()}
    assert all(g.abs().max().item() > 0 for g in grads.values())

    # ---- 3 AdamW steps in float64 on the same batch
    p = fresh_f64()
    opt = gpt_ref.make_adamw(p, OPT["lr"], (OPT["beta1"], OPT["beta2"]), OPT["eps"],
                             OPT["weight_decay"])
    losses, norms = [], []
    for _ in range(OPT["steps"]):
        opt.zero_grad(set_to_none=True)
        l = gpt_ref.loss_fn(gpt_ref.forward(p, idx, L, H), targets)
        l.backward()
        gn = torch.nn.utils.clip_grad_norm_(list(p.values()), OPT["clip"])
        losses.append(l.item())
        norms.append(gn.item())
        opt.step()

    # ---- assemble and write
    f32 = lambda t: t.detach().to(torch.float32).numpy()  # noqa: E731
    tensors = {}
    for k, v in w32.items():
        tensors[k] = v.numpy()
    tensors["input.idx"] = idx.numpy()
    tensors["input.targets"] = targets.numpy()
    tensors["expected.logits"] = f32(logits)
    tensors["expected.loss"] = np.array([loss.item()], dtype=np.float32)
    for k, g in grads.items():
        tensors["grad." + k] = f32(g)
    tensors["adamw.losses"] = np.array(losses, dtype=np.float32)
    tensors["adamw.grad_norms"] = np.array(norms, dtype=np.float32)
    for k, v in p.items():
        tensors["after_adamw." + k] = f32(v)

    meta = dict(CFG)
    meta.update(OPT)
    meta.update(seed=SEED, ignore_index=-1, ln_eps=gpt_ref.LN_EPS, compute_dtype="float64")
    meta = {k: repr(v) if isinstance(v, float) else str(v) for k, v in meta.items()}
    write_safetensors(OUT_PATH, tensors, meta)

    # ---- read back and compare bit-exactly
    back, bmeta = read_safetensors(OUT_PATH)
    assert set(back) == set(tensors) and bmeta == meta
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert np.array_equal(back[k], v), k

    size = os.path.getsize(OUT_PATH)
    assert size < 1 << 20
    print(f"wrote {OUT_PATH}: {len(tensors)} tensors, {size} bytes")
    print(f"loss {loss.item():.12f}  adamw losses {losses}  grad norms {norms}")


if __name__ == "__main__":
    main()
