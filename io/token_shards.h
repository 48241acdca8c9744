// llm.c token shards: a header of 256 little-endian int32 words (word 0 = magic 20240520,
// word 1 = version 1, word 2 = number of tokens), then that many uint16 GPT-2 tokens.
//
// A shard set is named by a glob (glob(3)) and taken in byte order of the file names. Its split
// into train and val follows llm.c's file names (fineweb_train_000001.bin, fineweb_val_000000.bin):
//   - a file whose name (not folder) contains "val" belongs to val, every other file to train;
//   - when all files are of one kind and there are several, the last one is held out as val;
//   - a single file keeps its first (1 - val_fraction) of tokens for train, the rest for val.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/file.h"  // kShardMagic

namespace sg::io {

constexpr int32_t kShardVersion = 1;
constexpr int64_t kShardHeaderBytes = 256 * 4;
constexpr int64_t kGpt2Vocab = 50257;

// Writes a shard atomically (tests, tools).
void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens);
// Validates the header against the file's length and returns the token count.
int64_t token_shard_size(const std::string& path);
// The whole shard, validated.
std::vector<uint16_t> read_token_shard(const std::string& path);

// The files matching a glob pattern (or naming one file: a file of that very name is taken as it is,
// [ ? * and all), sorted by name. Throws naming the pattern when nothing matches, after `what`
// (the flag or command it came from).
std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what = "data");

// A contiguous run of tokens inside one file: tokens [first, first + count) of the element array that
// starts at byte `data_offset`, each `elem_bytes` wide (2: shard tokens, 1: text bytes).
struct TokenRange {
  std::string path;
  int64_t data_offset = 0;
  int64_t elem_bytes = 2;
  int64_t first = 0;
  int64_t count = 0;
};

struct ShardSplit {
  std::vector<TokenRange> train, val;
};
// Applies the train/val convention above to a sorted list of validated shards.
ShardSplit split_token_shards(const std::vector<std::string>& files, double val_fraction);

}  // namespace sg::io
