#include "io/gpt2_tokenizer.h"

#include <algorithm>
#include <climits>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/file.h"
#include "io/unicode_ranges.h"

namespace sg::io {

namespace {

enum class CharClass { letter, number, space, other };

template <size_t N>
bool in_ranges(const unicode::CodeRange (&r)[N], uint32_t cp) {
  auto it = std::upper_bound(std::begin(r), std::end(r), cp, [](uint32_t c, const unicode::CodeRange& x) { return c < x.first; });
  return it != std::begin(r) && cp <= (it - 1)->last;
}

CharClass classify(uint32_t cp) {
  if (in_ranges(unicode::kLetter, cp)) return CharClass::letter;
  if (in_ranges(unicode::kNumber, cp)) return CharClass::number;
  if (in_ranges(unicode::kSpace, cp)) return CharClass::space;
  return CharClass::other;
}

// One character of the text: its bytes [at, at + len) and, when they are valid UTF-8, its code
// point (an invalid byte stands alone, as a character of class other).
struct Char {
  size_t at, len;
  uint32_t cp;
  CharClass cls;
};

std::vector<Char> decode_utf8(const std::string& s) {
  std::vector<Char> out;
  for (size_t i = 0; i < s.size();) {
    const auto b = uint8_t(s[i]);
    size_t len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    uint32_t cp = len == 1 ? b : len == 2 ? b & 0x1F : len == 3 ? b & 0x0F : b & 0x07;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) {
      const auto c = uint8_t(s[i + k]);
      ok = (c >> 6) == 0x2;
      cp = cp << 6 | (c & 0x3F);
    }
    // overlong forms, surrogates and code points past U+10FFFF are not UTF-8 either
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && cp >= kMin[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (!ok) {
      out.push_back({i, 1, b, CharClass::other});
      ++i;
    } else {
      out.push_back({i, len, cp, classify(cp)});
      i += len;
    }
  }
  return out;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | cp >> 6), s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | cp >> 12), s += char(0x80 | (cp >> 6 & 0x3F)), s += char(0x80 | (cp & 0x3F));
  }
}

// GPT-2's bytes_to_unicode: the printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF)
// stand for themselves; the other 68 bytes take U+0100, U+0101, ... in byte order. kByteSymbol[b]
// is the UTF-8 of byte b's character.
struct ByteMap {
  std::string symbol[256];
  std::unordered_map<uint32_t, uint8_t> byte_of;  // character -> byte
  ByteMap() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const uint32_t cp = printable ? b : next++;
      append_utf8(symbol[b], cp);
      byte_of[cp] = uint8_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

constexpr const char* kEndOfText = "<|endoftext|>";

}  // namespace

std::vector<std::string> Gpt2Tokenizer::split(const std::string& text) {
  const std::vector<Char> c = decode_utf8(text);
  const size_t n = c.size();
  auto cls = [&](size_t i) { return c[i].cls; };
  auto ascii = [&](size_t i, char ch) { return i < n && c[i].cp == uint32_t(uint8_t(ch)) && c[i].len == 1; };
  auto run_end = [&](size_t i, CharClass k) {
    while (i < n && cls(i) == k) ++i;
    return i;
  };
  std::vector<std::string> out;
  for (size_t i = 0; i < n;) {
    size_t end = i;
    if (ascii(i, '\'')) {  // 's|'t|'re|'ve|'m|'ll|'d
      if (ascii(i + 1, 's') || ascii(i + 1, 't') || ascii(i + 1, 'm') || ascii(i + 1, 'd')) end = i + 2;
      else if ((ascii(i + 1, 'r') || ascii(i + 1, 'v')) && ascii(i + 2, 'e')) end = i + 3;
      else if (ascii(i + 1, 'l') && ascii(i + 2, 'l')) end = i + 3;
    }
    // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: an optional U+0020, then a run of one class
    const size_t body = ascii(i, ' ') && i + 1 < n && cls(i + 1) != CharClass::space ? i + 1 : i;
    if (end == i && cls(body) != CharClass::space) end = run_end(body, cls(body));
    if (end == i) {  // `\s+(?!\S)|\s+`: whitespace, leaving its last character to a following piece
      const size_t j = run_end(i, CharClass::space);
      end = j == n || j - 1 == i ? j : j - 1;
    }
    out.push_back(text.substr(c[i].at, (end < n ? c[end].at : text.size()) - c[i].at));
    i = end;
  }
  return out;
}

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& vocab_json, const std::string& merges_txt, const std::string& source)
    : source_(source) {
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(vocab_json);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str("tokenizer ", source_, ": vocab.json is not JSON (", e.what(), ")"));
  }
  SG_CHECK(vocab.is_object() && !vocab.empty(), "tokenizer ", source_,
           ": vocab.json must be an object of token string -> id");
  tokens_.resize(vocab.size());
  std::vector<bool> seen(vocab.size());
  const ByteMap& bm = byte_map();
  for (auto& [sym, id] : vocab.items()) {
    SG_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < int64_t(vocab.size()) &&
                 !seen[size_t(id.get<int64_t>())],
             "tokenizer ", source_, ": vocab.json: token '", sym, "' has id ", id.dump(), " (ids must be 0..",
             vocab.size() - 1, ", each once)");
    const int64_t k = id.get<int64_t>();
    seen[size_t(k)] = true;
    ids_[sym] = k;
    std::string bytes;
    for (const Char& ch : decode_utf8(sym)) {
      auto it = bm.byte_of.find(ch.cp);
      if (it != bm.byte_of.end()) bytes += char(it->second);
      else bytes += sym.substr(ch.at, ch.len);  // a character outside the byte map stands for itself
    }
    tokens_[size_t(k)] = bytes;
  }
  if (auto it = ids_.find(kEndOfText); it != ids_.end()) eot_ = it->second;

  int line_no = 0;
  size_t pos = 0;
  while (pos < merges_txt.size()) {
    size_t nl = merges_txt.find('\n', pos);
    if (nl == std::string::npos) nl = merges_txt.size();
    std::string line = merges_txt.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    SG_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size() && line.find(' ', sp + 1) == std::string::npos,
             "tokenizer ", source_, ": merges.txt line ", line_no, ": '", line, "' is not two symbols and one space");
    const std::string merged = line.substr(0, sp) + line.substr(sp + 1);
    SG_CHECK(ids_.count(merged), "tokenizer ", source_, ": merges.txt line ", line_no, ": the merge '", line,
             "' makes '", merged, "', which vocab.json does not have");
    ranks_.emplace(line, int32_t(ranks_.size()));
  }
}

Gpt2Tokenizer Gpt2Tokenizer::load(const std::string& path) {
  SG_CHECK(std::filesystem::is_directory(path), "tokenizer ", path,
           ": expected a folder holding GPT-2's vocab.json and merges.txt (as a Hugging Face GPT-2 folder does)");
  const std::string vocab = (std::filesystem::path(path) / "vocab.json").string();
  const std::string merges = (std::filesystem::path(path) / "merges.txt").string();
  const std::string vocab_text = read_file(vocab, "tokenizer");  // named first when both are missing
  return Gpt2Tokenizer(vocab_text, read_file(merges, "tokenizer"), path);
}

void Gpt2Tokenizer::encode_piece(const std::string& piece, std::vector<int64_t>& out,
                                 std::unordered_map<std::string, std::vector<int64_t>>& cache) const {
  if (auto it = cache.find(piece); it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const ByteMap& bm = byte_map();
  std::vector<std::string> sym;
  for (unsigned char b : piece) sym.push_back(bm.symbol[b]);
  while (sym.size() > 1) {
    int32_t best = INT32_MAX;
    size_t at = 0;
    for (size_t k = 0; k + 1 < sym.size(); ++k) {
      auto it = ranks_.find(sym[k] + ' ' + sym[k + 1]);
      if (it != ranks_.end() && it->second < best) best = it->second, at = k;
    }
    if (best == INT32_MAX) break;
    const std::string first = sym[at], second = sym[at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < sym.size(); ++k) {
      if (k + 1 < sym.size() && sym[k] == first && sym[k + 1] == second) merged.push_back(first + second), ++k;
      else merged.push_back(sym[k]);
    }
    sym = std::move(merged);
  }
  std::vector<int64_t>& ids = cache[piece];
  for (const std::string& s : sym) {
    auto it = ids_.find(s);
    SG_CHECK(it != ids_.end(), "tokenizer ", source_, ": the symbol '", s, "' has no id in vocab.json");
    ids.push_back(it->second);
  }
  out.insert(out.end(), ids.begin(), ids.end());
}

std::vector<int64_t> Gpt2Tokenizer::encode(const std::string& text) const {
  std::vector<int64_t> out;
  std::unordered_map<std::string, std::vector<int64_t>> cache;  // GPT-2's word cache, for this call
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t special = eot_ >= 0 ? text.find(kEndOfText, pos) : std::string::npos;
    const size_t stop = special == std::string::npos ? text.size() : special;
    for (const std::string& piece : split(text.substr(pos, stop - pos))) encode_piece(piece, out, cache);
    if (special == std::string::npos) break;
    out.push_back(eot_);
    pos = special + std::string(kEndOfText).size();
  }
  return out;
}

std::vector<int64_t> Gpt2Tokenizer::encode_chunks(const std::string& text, size_t chunk_bytes,
                                                 const std::function<void(size_t)>& progress) const {
  std::vector<int64_t> out;
  const auto visible = [](char c) { return c > ' ' && c < 0x7F; };  // printable ASCII, not a space
  for (size_t start = 0; start < text.size();) {
    // The first cut at or past start + chunk_bytes just before a line end ('\n' or '\r') that a
    // visible character precedes: every piece of the pattern but whitespace stops at whitespace,
    // so the piece before the cut ends there whatever follows, and the whitespace run after it
    // starts there and is split by what follows it, the same in the whole text and in the part.
    // Not after a line end: the run's pieces depend on whether text follows. In "x\n\ny" they are
    // "\n" and "\n" (the pattern leaves a run's last character to what follows when that is not
    // space), while a part ending in "x\n\n" has "\n\n", which GPT-2's vocabulary merges into one
    // token (628, not 198 198).
    size_t cut = start + std::max<size_t>(chunk_bytes, 1);
    while (cut < text.size() && !(visible(text[cut - 1]) && (text[cut] == '\n' || text[cut] == '\r'))) {
      const size_t eol = text.find_first_of("\n\r", cut + 1);
      cut = eol == std::string::npos ? text.size() : eol;
    }
    cut = std::min(cut, text.size());
    std::vector<int64_t> part = encode(text.substr(start, cut - start));
    out.insert(out.end(), part.begin(), part.end());
    start = cut;
    progress(start);
  }
  return out;
}

std::string Gpt2Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    SG_CHECK(id >= 0 && id < vocab_size(), "tokenizer ", source_, ": token id ", id, " is outside its vocabulary of ",
             vocab_size());
    out += tokens_[size_t(id)];
  }
  return out;
}

}  // namespace sg::io
