// GPT-2's byte-level BPE tokenizer, read from the two files a Hugging Face GPT-2 folder holds:
// vocab.json (token string -> id) and merges.txt (one merge per line, best first).
//
// Encoding, as GPT-2's encoder does it:
//   1. "<|endoftext|>" in the text is the end-of-text token itself (as Hugging Face's tokenizer
//      treats it), when the vocabulary has one;
//   2. the rest is split into pieces by GPT-2's pattern
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (letters, numbers and whitespace as in io/unicode_ranges.h; text that is not UTF-8 is split
//      byte by byte into the "other" class, so every byte string encodes);
//   3. each piece's bytes become printable characters (bytes_to_unicode: the printable Latin-1
//      bytes stand for themselves, the 68 others for U+0100 onwards), one symbol per byte;
//   4. the adjacent pair of symbols with the best (lowest) merge rank is merged, everywhere in the
//      piece, until no pair has a rank; each symbol is then looked up in the vocabulary.
// Decoding maps each token's characters back to bytes and concatenates them.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace sg::io {

class Gpt2Tokenizer {
 public:
  // `path`: a folder holding vocab.json and merges.txt. Throws naming the file and line that is
  // missing or malformed, or a merge whose result is not in the vocabulary.
  static Gpt2Tokenizer load(const std::string& path);
  // From the two files' contents (`source` names them in errors).
  Gpt2Tokenizer(const std::string& vocab_json, const std::string& merges_txt, const std::string& source);

  std::vector<int64_t> encode(const std::string& text) const;
  // encode() of a long text in parts of about chunk_bytes, cut only where the pieces are the same
  // either way (just before a '\n' or '\r' that a printable ASCII character other than space
  // precedes), so the ids are encode(text)'s; progress(done bytes) is called after each part.
  std::vector<int64_t> encode_chunks(const std::string& text, size_t chunk_bytes,
                                     const std::function<void(size_t)>& progress) const;
  // Throws naming an id outside the vocabulary.
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t vocab_size() const { return int64_t(tokens_.size()); }
  int64_t eot() const { return eot_; }  // "<|endoftext|>", or -1 when the vocabulary has none
  const std::string& source() const { return source_; }

  // Step 2 alone: the pieces the pattern cuts the text into (tests).
  static std::vector<std::string> split(const std::string& text);

 private:
  void encode_piece(const std::string& piece, std::vector<int64_t>& out,
                    std::unordered_map<std::string, std::vector<int64_t>>& cache) const;

  std::string source_;
  std::unordered_map<std::string, int64_t> ids_;     // symbol (UTF-8 of the mapped characters) -> id
  std::vector<std::string> tokens_;                  // id -> the bytes it stands for
  std::unordered_map<std::string, int32_t> ranks_;   // "left right" (merges.txt's line) -> rank
  int64_t eot_ = -1;
};

}  // namespace sg::io
