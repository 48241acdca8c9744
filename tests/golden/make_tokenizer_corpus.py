"""Generate tests/golden/tokenizer_corpus/: texts that stress GPT-2's pre-tokenizer, the inputs of
scripts/check_gpt2_tokenizer.sh (shardgrad's tokenizer against GPT-2's own vocabulary).

Run from the repository root (deterministic; rewrites the files byte for byte):
    python3 tests/golden/make_tokenizer_corpus.py

Each text is 4000 draws, seeded: a word from WORDS (contractions in both cases, numbers, accents
precomposed and combining, several scripts, emoji sequences, "<|endoftext|>" whole and cut, code),
a run of whitespace from SPACES, or 1-6 characters of one general category (letters, marks,
numbers, punctuation, symbols, separators) drawn from every code point Python's unicodedata
assigns. Left out: unassigned, private-use and surrogate code points, and U+0085, U+180E and
U+FEFF, where JavaScript's \\s (the oracle's) differs from Unicode's White_Space (GPT-2's).
"""
import os
import random
import unicodedata

WORDS = ["the", "The", "it's", "IT'S", "we'll", "they'd", "I'm", "you're", "'ve", "don't", "O'Neil", "'''",
         "''s", "1,000", "3.14", "2026", "x86_64", "naïve", "café", "Straße", "東京", "русский", "ελληνικά",
         "עברית", "العربية", "हिन्दी", "한국어", "😀👍🏽", "👨‍👩‍👧", "e\u0301", "١٢٣", "Ⅻ", "½", "²",
         "<|endoftext|>", "<|endoftext", "http://x.y/z?a=1&b=2", "def f(x):\n    return x", "    ", "\t\t",
         "...", "!!!", "—", "“quoted”"]
SPACES = [" ", " ", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\xa0", "\u3000", "\u2003", " \n", "\u2028", "\x0b", "\x0c"]


def pools():
    out = {}
    for cp in range(0x20, 0x30000):
        if 0xD800 <= cp <= 0xDFFF or cp in (0x85, 0x180E, 0xFEFF):
            continue
        cat = unicodedata.category(chr(cp))
        if cat not in ("Cn", "Co", "Cs"):
            out.setdefault(cat[0], []).append(chr(cp))
    return out


def text(seed, by_class):
    rng, out = random.Random(seed), []
    for _ in range(4000):
        r = rng.random()
        if r < 0.35:
            out.append(rng.choice(WORDS))
        elif r < 0.6:
            out.append(rng.choice(SPACES))
        else:
            k = rng.choice("LNPSMZ")
            out.append("".join(rng.choice(by_class[k]) for _ in range(rng.randint(1, 6))))
    return "".join(out)


if __name__ == "__main__":
    by_class = pools()
    os.makedirs("tests/golden/tokenizer_corpus", exist_ok=True)
    for seed in (1, 2):
        with open(f"tests/golden/tokenizer_corpus/unicode{seed}.txt", "w", encoding="utf-8", newline="") as f:
            f.write(text(seed, by_class))
