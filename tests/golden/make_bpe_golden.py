"""Generate tests/golden/bpe/: a small GPT-2-style byte-level BPE tokenizer and its encodings,
the oracle for io/gpt2_tokenizer's test.

Run from the repository root (deterministic; rewrites the files byte for byte):
    python3 tests/golden/make_bpe_golden.py
Needs Python's `regex` module (Debian: python3-regex), as GPT-2's own encoder does.

What it writes:
  vocab.json   the 256 byte symbols (ids 0..255, in byte order), then one symbol per merge, then
               "<|endoftext|>" last, in the Hugging Face GPT-2 file format;
  merges.txt   "#version: 0.2", then the merges learned on CORPUS below, best first (355: every
               piece of CORPUS is one symbol by then);
  cases.json   [{"text", "pieces", "ids"}]: each case's pre-tokenizer pieces (GPT-2's pattern,
               matched by `regex`) and its ids (the lowest-ranked pair merged everywhere, until
               none is left; "<|endoftext|>" in the text is the end-of-text token).
The merges are learned as byte-level BPE is: the pieces of CORPUS are counted, and each round
merges the most frequent adjacent pair (ties: the smallest pair in string order).
"""
import json
import os

import regex

PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOT = "<|endoftext|>"
MERGES = 400

CORPUS = """
The tokenizer cuts text into pieces before it merges anything: words with the space in front of
them, runs of digits, runs of punctuation, and whitespace. It's the pieces that the merges work on,
so a merge never crosses from one word into the next. We'll train the model on these tokens, and
they'd better be the same tokens the reference gives, or the loss we report isn't the loss they
report. Numbers like 1024, 50257 and 3.14159 are split from the words around them; so are dots...
and commas, and quotes 'like these' and "these". Tabs\tand newlines
count as whitespace; two  spaces   or more leave their last one to the word that follows.
Café, naïve, résumé, Straße and Ærø are letters too; so are αβγ δέλτα, Москва, 東京 and 서울.
The superscripts ² and ³ and the fraction ½ are numbers. Emoji 🙂 and signs like € and © are neither.
The model learns, the model learns again, and the model learns once more: repetition makes merges.
"""

CASES = [
    "Hello world",
    "Hello, world! It's a test; they'll see we're fine, I'm sure, you've done it, he'd go.",
    "Capital 'S and 'T are not contractions: DON'T and I'M",
    "  leading spaces, trailing spaces   ",
    "a   b\t\tc\n\nd \n e",
    "line one\nline two\r\nline three\n",
    "numbers 1024 and 3.14159 and 1,000,000 and 2024-11-24",
    "superscripts x² y³ and ½ cup",
    "Café naïve résumé Straße Ærø",
    "Greek αβγ δέλτα, Russian Москва, Japanese 東京, Korean 서울",
    "emoji 🙂👍🏽 and signs € © ™ ...!!!???",
    "no\u00a0break\u2003em space\u3000ideographic",
    "first document<|endoftext|>second document<|endoftext|>",
    "<|endoftext|>",
    "the model learns, the model learns again",
    "'''quotes''' and \"double\" and `back`",
    "",
    " ",
    "\n",
    "x",
]


def bytes_to_unicode():
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


BYTE_CHAR = bytes_to_unicode()


def symbols(piece):
    return [BYTE_CHAR[b] for b in piece.encode("utf-8")]


def learn_merges(corpus, count):
    words = {}
    for piece in PATTERN.findall(corpus):
        key = tuple(symbols(piece))
        words[key] = words.get(key, 0) + 1
    merges = []
    for _ in range(count):
        pairs = {}
        for w, f in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for w, f in words.items():
            out, k = [], 0
            while k < len(w):
                if k + 1 < len(w) and (w[k], w[k + 1]) == best:
                    out.append(w[k] + w[k + 1])
                    k += 2
                else:
                    out.append(w[k])
                    k += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + f
        words = merged
    return merges


def bpe(piece, ranks):
    word = symbols(piece)
    while len(word) > 1:
        pairs = [(ranks[p], p) for p in zip(word, word[1:]) if p in ranks]
        if not pairs:
            break
        first, second = min(pairs)[1]
        out, k = [], 0
        while k < len(word):
            if k + 1 < len(word) and word[k] == first and word[k + 1] == second:
                out.append(first + second)
                k += 2
            else:
                out.append(word[k])
                k += 1
        word = out
    return word


def main():
    out_dir = os.path.join("tests", "golden", "bpe")
    os.makedirs(out_dir, exist_ok=True)
    merges = learn_merges(CORPUS, MERGES)
    vocab = {BYTE_CHAR[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[EOT] = len(vocab)
    ranks = {m: i for i, m in enumerate(merges)}
    cases = []
    for text in CASES:
        pieces, ids = [], []
        for k, part in enumerate(text.split(EOT)):
            if k > 0:
                ids.append(vocab[EOT])
            for piece in PATTERN.findall(part):
                pieces.append(piece)
                ids.extend(vocab[s] for s in bpe(piece, ranks))
        cases.append({"text": text, "pieces": pieces, "ids": ids})
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    with open(os.path.join(out_dir, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(merges)} merges, {len(vocab)} tokens, {len(cases)} cases -> {out_dir}")


if __name__ == "__main__":
    main()
