"""Generate tests/golden/hellaswag_tiny.bin and hellaswag_tiny.json, the PyTorch oracle for the C++
multiple-choice (HellaSwag) scoring test.

Run from the repository root (deterministic; rewrites both files byte for byte):
    /usr/bin/python3 tests/golden/make_hellaswag_golden.py
Needs only Debian's python3-torch (1.13, CPU) and numpy.

The model is gpt_tiny.safetensors' initial weights (n_layer 2, n_head 4, n_embd 32, block_size 16,
vocab 61; tests/golden/gpt_ref.py). torch.manual_seed(4321), then 16 examples are drawn: a context
of 1-14 tokens (example 5: 15, cropped), 4 endings of 1-6 tokens (example 3 has 2 endings, example 7 has 5), a label. The
draw is repeated until, in every example, the lowest mean loss and the lowest summed loss beat the
runner-up by more than 1e-3, so that float32 rounding cannot change an answer.

The .bin file is llm.c's eval file, written here by its format alone (a header of 256 int32: magic
20240522, version 1, the example count, the longest example's bytes; then per example the uint16
words 65535, its bytes, its index, the label, the ending count, the context's length and tokens,
each ending's length and tokens).

Scoring, "completion style" as llm.c's dev/data/hellaswag.py: each ending after the context in a
row of its own; the cross-entropy of the ending's tokens, each predicted from everything before
it; the ending with the lowest mean (acc_norm) and the lowest sum (acc). A context that would make
a row longer than block_size + 1 tokens keeps only its last block_size + 1 - longest ending tokens
(the same count for all of an example's endings). Rows are fed without their last token (it
predicts nothing), so a row of block_size + 1 tokens fits the model. Computed in float64.

hellaswag_tiny.json: {"examples": [{"label", "context", "endings", "mean_loss" (per ending),
"chosen", "chosen_sum"}], "correct", "correct_sum"}.
"""

import json
import os
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.dont_write_bytecode = True
sys.path.insert(0, HERE)
import gpt_ref  # noqa: E402
from make_gpt_golden import read_safetensors  # noqa: E402

N_LAYER, N_HEAD, BLOCK, VOCAB = 2, 4, 16, 61


def write_evalfile(path, examples):
    words, longest = [], 0
    for i, e in enumerate(examples):
        ex = [65535, 0, i, e["label"], len(e["endings"]), len(e["context"])] + e["context"]
        for end in e["endings"]:
            ex += [len(end)] + end
        ex[1] = 2 * len(ex)
        longest = max(longest, ex[1])
        words += ex
    header = np.zeros(256, dtype="<i4")
    header[:4] = [20240522, 1, len(examples), longest]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(words, dtype="<u2").tobytes())


def score(p, e):
    longest = max(len(end) for end in e["endings"])
    keep = min(len(e["context"]), BLOCK + 1 - longest)
    ctx = e["context"][len(e["context"]) - keep:]
    means, sums = [], []
    for end in e["endings"]:
        row = ctx + end
        idx = torch.tensor([row[:-1]], dtype=torch.int64)
        logits = gpt_ref.forward(p, idx, N_LAYER, N_HEAD)[0]
        logp = torch.log_softmax(logits, dim=-1)
        nll = [-logp[t, row[t + 1]].item() for t in range(keep - 1, len(row) - 1)]
        means.append(sum(nll) / len(nll))
        sums.append(sum(nll))
    return means, sums


def gap(v):
    s = sorted(v)
    return s[1] - s[0]


def main():
    weights, _ = read_safetensors(os.path.join(HERE, "gpt_tiny.safetensors"))
    p = {k: torch.from_numpy(np.array(v)).to(torch.float64) for k, v in weights.items()
         if not k.startswith(("input.", "expected.", "grad.", "adamw.", "after_adamw."))}
    torch.manual_seed(4321)
    examples = []
    while len(examples) < 16:
        i = len(examples)
        n_end = 2 if i == 3 else 5 if i == 7 else 4
        ctx_len = 15 if i == 5 else int(torch.randint(1, 15, (1,)))
        e = {"label": int(torch.randint(0, n_end, (1,))),
             "context": torch.randint(0, VOCAB, (ctx_len,)).tolist(),
             "endings": [torch.randint(0, VOCAB, (int(torch.randint(1, 7, (1,))),)).tolist()
                         for _ in range(n_end)]}
        means, sums = score(p, e)
        if gap(means) <= 1e-3 or gap(sums) <= 1e-3:
            continue
        e["mean_loss"] = means
        e["chosen"] = int(np.argmin(means))
        e["chosen_sum"] = int(np.argmin(sums))
        examples.append(e)
    # some examples' contexts must be cropped, and some answers right under each rule
    assert any(len(e["context"]) + max(map(len, e["endings"])) > BLOCK + 1 for e in examples)
    out = {"examples": examples,
           "correct": sum(e["chosen"] == e["label"] for e in examples),
           "correct_sum": sum(e["chosen_sum"] == e["label"] for e in examples)}
    assert any(e["chosen"] != e["chosen_sum"] for e in examples)  # the two rules tell apart
    write_evalfile(os.path.join(HERE, "hellaswag_tiny.bin"), examples)
    with open(os.path.join(HERE, "hellaswag_tiny.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"correct {out['correct']} (mean), {out['correct_sum']} (sum) of {len(examples)}")


if __name__ == "__main__":
    main()
