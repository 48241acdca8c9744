// io/: safetensors round-trips every dtype and refuses every malformed file naming it; saves are
// atomic; token shards are validated; file datasets yield exactly the expected token windows and
// resume exactly; the synthetic task is deterministic, split-disjoint and scored correctly; GPT-2's
// tokenizer matches its Python oracle.
#include "tests/catch.h"
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "autograd/ops.h"
#include "io/dataset.h"
#include "io/gpt2_tokenizer.h"
#include "io/multiple_choice.h"
#include "io/safetensors.h"
#include "io/synthetic.h"
#include "io/token_shards.h"
#include "models/gpt.h"

using namespace sg;
using namespace sg::io;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() / ("sg_io_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file from a literal header (padded to 8) and `data_bytes` zero bytes of data.
void write_raw_safetensors(const std::string& path, std::string header, size_t data_bytes) {
  header.append((8 - header.size() % 8) % 8, ' ');
  uint64_t n = header.size();
  std::string bytes(reinterpret_cast<const char*>(&n), 8);
  write_bytes(path, bytes + header + std::string(data_bytes, '\0'));
}

std::vector<float> iota_f(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i) * 0.5f - 3.0f;
  return v;
}

std::vector<int64_t> row(const Tensor& t, int64_t r) {
  std::vector<int64_t> all = to_vector<int64_t>(t);
  const int64_t T = t.size(1);
  return std::vector<int64_t>(all.begin() + r * T, all.begin() + (r + 1) * T);
}

std::vector<int64_t> range(int64_t lo, int64_t hi) {
  std::vector<int64_t> v;
  for (int64_t i = lo; i < hi; ++i) v.push_back(i);
  return v;
}

std::vector<uint16_t> range_u16(int lo, int hi) {
  std::vector<uint16_t> v;
  for (int i = lo; i < hi; ++i) v.push_back(uint16_t(i));
  return v;
}

// "321" -> 123: the task writes numbers least-significant digit first.
uint64_t lsb_first(const std::string& digits) { return std::stoull(std::string(digits.rbegin(), digits.rend())); }

bool same_batch(const Batch& a, const Batch& b) {
  return to_vector<int64_t>(a.inputs) == to_vector<int64_t>(b.inputs) &&
         to_vector<int64_t>(a.targets) == to_vector<int64_t>(b.targets);
}

}  // namespace

// ---- safetensors ----

TEST_CASE("safetensors round-trips every dtype, views, empty tensors, scalars and metadata", "[io]") {
  TempDir d;
  const std::string path = d / "model.safetensors";
  Tensor f32 = from_vector(iota_f(6), {2, 3});
  Tensor f32_t = transpose(f32, 0, 1);  // non-contiguous: written as the [3,2] it shows
  Tensor f64 = from_vector(std::vector<double>{1.0 / 3, -2.5, 1e300}, {3});
  Tensor bf16 = to(from_vector(iota_f(8), {2, 4}), DType::bf16);
  Tensor f16 = to(from_vector(iota_f(5), {5}), DType::f16);
  Tensor i32 = from_vector(std::vector<int32_t>{-7, 0, 2147483647, 3}, {2, 2});
  Tensor i64 = from_vector(std::vector<int64_t>{-1, int64_t(1) << 40, 5}, {3, 1});
  Tensor none = zeros({0, 4});
  Tensor scalar = from_vector(std::vector<float>{4.25f}, {});
  NamedTensors in = {{"f32_t", f32_t}, {"f64", f64}, {"bf16", bf16}, {"f16", f16},
                     {"i32", i32},     {"i64", i64}, {"empty", none}, {"scalar", scalar}};
  save_safetensors(path, in, {{"format", "pt"}, {"data", "synthetic"}});

  SafetensorsFile f = load_safetensors(path);
  CHECK(f.path == path);
  CHECK(f.order == std::vector<std::string>{"f32_t", "f64", "bf16", "f16", "i32", "i64", "empty", "scalar"});
  CHECK(f.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"data", "synthetic"}});
  for (const auto& [name, t] : in) {
    INFO(name);
    const Tensor& g = f.at(name);
    CHECK(g.dtype() == t.dtype());
    CHECK(g.shape() == t.shape());
    CHECK(g.device() == Device::cpu());
    CHECK(to_vector<double>(g) == to_vector<double>(t));  // bit-exact for every dtype here
  }
  CHECK(to_vector<float>(f.at("f32_t")) == std::vector<float>{-3, -1.5, -2.5, -1, -2, -0.5});

  // The header is padded to a multiple of 8 so the data section stays aligned.
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  CHECK(bytes.size() == 8 + n + 6 * 4 + 3 * 8 + 8 * 2 + 5 * 2 + 4 * 4 + 3 * 8 + 0 + 4);

  REQUIRE_THROWS_WITH(f.at("missing"), Contains(path) && Contains("'missing'"));
}

TEST_CASE("safetensors reads only the tensors a filter names: the others are their shape and dtype, no bytes", "[io]") {
  TempDir d;
  const std::string path = d / "part.safetensors";
  save_safetensors(path, {{"a", from_vector(iota_f(6), {2, 3})}, {"b", to(from_vector(iota_f(4), {4}), DType::bf16)},
                          {"c", from_vector(std::vector<int64_t>{9, 8}, {2, 1})}},
                   {{"n_head", "2"}});
  const int64_t before = Ledger::global().stats(Device::cpu()).total_current;
  SafetensorsFile f = load_safetensors(path, [](const std::string& n) { return n == "b"; });
  CHECK(Ledger::global().stats(Device::cpu()).total_current - before == 4 * 2);  // b's bytes alone are on the host
  CHECK(f.order == std::vector<std::string>{"a", "b", "c"});
  CHECK(f.metadata.at("n_head") == "2");
  CHECK(f.at("b").device() == Device::cpu());
  CHECK(to_vector<float>(f.at("b")) == to_vector<float>(to(from_vector(iota_f(4), {4}), DType::bf16)));
  for (const auto& [name, shape, dtype] : {std::tuple{"a", Shape{2, 3}, DType::f32}, std::tuple{"c", Shape{2, 1}, DType::i64}}) {
    INFO(name);
    CHECK(f.at(name).device().is_meta());
    CHECK(f.at(name).shape() == shape);
    CHECK(f.at(name).dtype() == dtype);
  }
  // A header read alone is still checked against the whole file: a cut data section is refused.
  const std::string bytes = read_bytes(path);
  const std::string cut = d / "cut.safetensors";
  write_bytes(cut, bytes.substr(0, bytes.size() - 1));
  REQUIRE_THROWS_WITH(load_safetensors(cut, [](const std::string&) { return false; }), Contains(cut));
}

TEST_CASE("safetensors save is atomic: no temporary file is left, an existing file is replaced", "[io]") {
  TempDir d;
  const std::string path = d / "w.safetensors";
  save_safetensors(path, {{"a", ones({3})}});
  save_safetensors(path, {{"b", zeros({2})}});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d.path)) names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"w.safetensors"});
  CHECK(load_safetensors(path).order == std::vector<std::string>{"b"});

  // A failed save names the file and leaves nothing behind.
  REQUIRE_THROWS_WITH(save_safetensors(path, {{"x", ones({1})}, {"x", ones({1})}}), Contains(path) && Contains("'x'"));
  const std::string missing = d / "no/such/dir/w.safetensors";
  REQUIRE_THROWS_WITH(save_safetensors(missing, {{"a", ones({1})}}), Contains(missing));
  CHECK(std::distance(fs::directory_iterator(d.path), fs::directory_iterator()) == 1);
}

TEST_CASE("safetensors refuses truncated files at every stage, naming the file", "[io]") {
  TempDir d;
  const std::string good = d / "good.safetensors";
  save_safetensors(good, {{"w", from_vector(iota_f(16), {4, 4})}, {"b", from_vector(iota_f(4), {4})}});
  const std::string bytes = read_bytes(good);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  for (size_t cut : {size_t(0), size_t(4), size_t(7), size_t(8), size_t(20), size_t(8 + n - 1), size_t(8 + n),
                     size_t(8 + n + 3), bytes.size() - 1}) {
    INFO("truncated to " << cut << " bytes");
    const std::string p = d / ("cut" + std::to_string(cut) + ".safetensors");
    write_bytes(p, bytes.substr(0, cut));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p));
  }
  // Trailing bytes after the last tensor are as wrong as missing ones.
  const std::string longer = d / "long.safetensors";
  write_bytes(longer, bytes + "xyz");
  REQUIRE_THROWS_WITH(load_safetensors(longer), Contains(longer) && Contains("belong to no tensor"));
  REQUIRE_THROWS_WITH(load_safetensors(d / "absent.safetensors"), Contains("absent.safetensors") && Contains("cannot open"));
}

TEST_CASE("safetensors refuses malformed headers, naming the file and the tensor", "[io]") {
  TempDir d;
  const std::string p = d / "bad.safetensors";
  auto refuses = [&](const std::string& header, size_t data, const std::string& why) {
    INFO(header);
    write_raw_safetensors(p, header, data);
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains(why));
  };
  const std::string a8 = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

  // Header length: beyond the file, beyond 100 MB; with no JSON header after it, another kind of file.
  for (uint64_t n : {uint64_t(64), uint64_t(200'000'000), ~uint64_t(0)}) {
    std::string bytes(reinterpret_cast<const char*>(&n), 8);
    write_bytes(p, bytes + "{" + std::string(15, ' '));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("header length"));
    write_bytes(p, bytes + std::string(16, ' '));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p + ": not a safetensors file (no 8-byte header length followed "
                                                      "by a JSON header)"));
  }
  write_bytes(p, "First Citizen:\nBefore we proceed any further, hear me speak.\n");  // a text
  REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p + ": not a safetensors file"));
  refuses("{not json", 0, "not valid JSON");
  refuses("[1,2]", 0, "not an object");
  refuses("{" + a8 + "," + a8 + "}", 8, "names 'a' twice");
  refuses(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8, "'a': missing dtype");
  refuses(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", 2, "'a': unsupported dtype 'F8_E4M3'");
  refuses(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", 8, "'a': dtype is not a string");
  refuses(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "'a': shape [-2] is not a list of non-negative");
  refuses(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, "non-negative integers");
  refuses(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8, "'a': shape is not a list");
  refuses(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, "'a': missing shape");
  refuses(R"({"a":{"dtype":"F32","shape":[2]}})", 8, "'a': missing data_offsets");
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "is not [begin, end]");
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", 8, "'a': unknown field 'extra'");
  refuses(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, "64 bits");
  refuses(R"({"a":{"dtype":"I64","shape":[1152921504606846976,2],"data_offsets":[0,8]}})", 8, "64 bits");
  // Offsets: out of range, reversed, wrong size, overlapping, leaving a hole or a tail.
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "'a': data_offsets [0, 8] do not lie within");
  refuses(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, "do not lie within");
  refuses(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
          "'a': data_offsets [0, 8] hold 8 bytes but F32 [3] needs 12");
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12, "'b' bytes [4, 12) overlap tensor 'a'");
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
          20, "hole before tensor 'b'");
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, "hole before tensor 'a'");
  refuses(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12,
          "last 4 bytes of the data section belong to no tensor");
  refuses(R"({"__metadata__":{"k":1}})", 0, "'k' is not a string");
  refuses(R"({"__metadata__":[1]})", 0, "__metadata__ is not an object");

  // Out-of-order offsets are fine as long as the bytes are covered exactly; so is an empty file body.
  write_raw_safetensors(
      p, R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
      16);
  CHECK(load_safetensors(p).order == std::vector<std::string>{"b", "a"});
  write_raw_safetensors(p, "{}", 0);
  CHECK(load_safetensors(p).tensors.empty());
}

// ---- token shards ----

TEST_CASE("token shards round-trip and refuse a bad magic, version or length, naming the file", "[io]") {
  TempDir d;
  const std::string p = d / "s_train_000.bin";
  const std::vector<uint16_t> tokens = {50256, 0, 1, 65535, 42};
  write_token_shard(p, tokens);
  CHECK(fs::file_size(p) == 1024 + 2 * tokens.size());
  CHECK(token_shard_size(p) == 5);
  CHECK(read_token_shard(p) == tokens);

  const std::string good = read_bytes(p);
  auto corrupt = [&](size_t at, int32_t value) {
    std::string b = good;
    std::memcpy(b.data() + at, &value, 4);
    return b;
  };
  const std::string q = d / "bad.bin";
  write_bytes(q, corrupt(0, 12345));
  REQUIRE_THROWS_WITH(read_token_shard(q), Contains(q) && Contains("magic number 12345"));
  write_bytes(q, corrupt(4, 2));
  REQUIRE_THROWS_WITH(read_token_shard(q), Contains(q) && Contains("version 2"));
  write_bytes(q, corrupt(8, 6));
  REQUIRE_THROWS_WITH(read_token_shard(q), Contains(q) && Contains("says 6 tokens"));
  write_bytes(q, corrupt(8, -1));
  REQUIRE_THROWS_WITH(read_token_shard(q), Contains(q) && Contains("negative token count -1"));
  write_bytes(q, good + "x");
  REQUIRE_THROWS_WITH(token_shard_size(q), Contains(q) && Contains("1035 bytes"));
  write_bytes(q, good.substr(0, 100));
  REQUIRE_THROWS_WITH(token_shard_size(q), Contains(q) && Contains("shorter than the 1024-byte header"));
}

TEST_CASE("shard globs sort by name and split by the llm.c val convention", "[io]") {
  TempDir d;
  for (const char* n : {"fw_train_000002.bin", "fw_val_000000.bin", "fw_train_000001.bin"})
    write_token_shard(d / n, range_u16(0, 10));
  const auto files = expand_glob(d / "fw_*.bin");
  REQUIRE(files.size() == 3);
  CHECK(files[0] == d / "fw_train_000001.bin");
  CHECK(files[2] == d / "fw_val_000000.bin");
  REQUIRE_THROWS_WITH(expand_glob(d / "nope_*.bin"), Contains("nope_*.bin") && Contains("no files match"));
  REQUIRE_THROWS_WITH(expand_glob(d / "plain.bin"), Contains("plain.bin") && Contains("no such file"));

  ShardSplit named = split_token_shards(files, 0.1);
  REQUIRE(named.train.size() == 2);
  REQUIRE(named.val.size() == 1);
  CHECK(named.val[0].path == d / "fw_val_000000.bin");

  ShardSplit held = split_token_shards({files[0], files[1]}, 0.1);  // train only: the last is held out
  REQUIRE(held.train.size() == 1);
  CHECK(held.train[0].path == files[0]);
  CHECK(held.val[0].path == files[1]);

  ShardSplit single = split_token_shards({files[0]}, 0.3);  // one file: its tail
  CHECK(single.train[0].first == 0);
  CHECK(single.train[0].count == 7);
  CHECK(single.val[0].first == 7);
  CHECK(single.val[0].count == 3);

  // The datasets name their files, so the held-out shard is seen in train's header.
  DataOptions opt;
  opt.spec = d / "fw_train_*.bin";
  CHECK_THAT(open_dataset(opt)->describe(), Contains("train split of 10 tokens in 1 file (fw_train_000001.bin)"));
  opt.split = Split::val;
  CHECK_THAT(open_dataset(opt)->describe(), Contains("val split of 10 tokens in 1 file (fw_train_000002.bin)"));
  for (const char* n : {"fw_train_000003.bin", "fw_train_000004.bin", "fw_train_000005.bin"})
    write_token_shard(d / n, range_u16(0, 10));
  opt.split = Split::train;
  CHECK_THAT(open_dataset(opt)->describe(), Contains("in 4 files (fw_train_000001.bin, ..., fw_train_000004.bin)"));
}

// ---- file datasets ----

TEST_CASE("shard dataset: batch k is the k-th window of B*T+1 tokens across shards, then wraps", "[io]") {
  TempDir d;
  write_token_shard(d / "t_train_0.bin", range_u16(0, 100));
  write_token_shard(d / "t_train_1.bin", range_u16(100, 200));
  write_token_shard(d / "t_val_0.bin", range_u16(1000, 1050));
  DataOptions o;
  o.spec = d / "t_*.bin";
  auto ds = open_dataset(o);
  CHECK(ds->vocab_size() == 50257);
  const int64_t B = 2, T = 8;
  for (int64_t k = 0; k < 12; ++k) {  // 16k + 17 <= 200 for k <= 11; batch 6 straddles the shards
    INFO("batch " << k);
    CHECK(ds->position() == 16 * k);
    Batch b = ds->next(B, T);
    REQUIRE(b.inputs.shape() == Shape{2, 8});
    CHECK(b.inputs.dtype() == DType::i64);
    for (int64_t r = 0; r < B; ++r) {
      CHECK(row(b.inputs, r) == range(16 * k + 8 * r, 16 * k + 8 * r + 8));
      CHECK(row(b.targets, r) == range(16 * k + 8 * r + 1, 16 * k + 8 * r + 9));
    }
  }
  Batch wrapped = ds->next(B, T);  // 192 + 17 > 200: back to the start
  CHECK(row(wrapped.inputs, 0) == range(0, 8));
  CHECK(ds->position() == 16);

  o.split = Split::val;
  auto val = open_dataset(o);
  CHECK(row(val->next(B, T).inputs, 0) == range(1000, 1008));
  REQUIRE_THROWS_WITH(val->next(4, 16), Contains(o.spec) && Contains("50 tokens") && Contains("B*T+1 = 65"));

  write_token_shard(d / "big.bin", {1, 2, 60000, 4});
  o.spec = d / "big.bin";
  o.split = Split::train;
  o.val_fraction = 0;
  REQUIRE_THROWS_WITH(open_dataset(o)->next(1, 3), Contains("big.bin") && Contains("token 60000"));
  // another tokenizer's shards take a larger vocabulary too (uint16 ids: 65536 at most)
  auto wide = open_dataset(o);
  wide->restrict_vocab(60001);
  CHECK(row(wide->next(1, 3).inputs, 0) == std::vector<int64_t>{1, 2, 60000});
  REQUIRE_THROWS_WITH(wide->restrict_vocab(65537), Contains("a vocabulary of 65537 is past their 65536"));
  CHECK_THROWS_WITH(wide->decode({1}), Contains("token shards carry no tokenizer"));
  wide->restrict_vocab(256);  // a 256-token tokenizer's shards are not text bytes
  CHECK_THROWS_WITH(wide->decode({1}), Contains("token shards carry no tokenizer"));
  // a shard by another name, or with [ ] in its name, is read as a shard (it was read as text bytes,
  // or taken for a glob matching nothing)
  for (const char* name : {"corpus.tok", "notes[1].bin"}) {
    INFO(name);
    write_token_shard(d / name, {5, 6, 7, 8});
    o.spec = d / name;
    CHECK(is_shard_spec(o.spec));
    CHECK(row(open_dataset(o)->next(1, 3).inputs, 0) == std::vector<int64_t>{5, 6, 7});
  }
  std::ofstream(d / "plain[1].txt") << "hello world";  // a text file with [ ] in its name is text
  o.spec = d / "plain[1].txt";
  CHECK_FALSE(is_shard_spec(o.spec));
  CHECK(open_dataset(o)->vocab_size() == 256);
}

TEST_CASE("file datasets resume exactly from position()", "[io]") {
  TempDir d;
  write_token_shard(d / "a.bin", range_u16(0, 500));
  for (bool shuffle : {false, true}) {
    INFO("shuffle " << shuffle);
    DataOptions o;
    o.spec = d / "a.bin";
    o.shuffle = shuffle;
    o.seed = 7;
    auto first = open_dataset(o);
    for (int i = 0; i < 3; ++i) first->next(3, 10);
    const int64_t p = first->position();
    std::vector<Batch> rest;
    for (int i = 0; i < 4; ++i) rest.push_back(first->next(3, 10));
    auto second = open_dataset(o);
    second->set_position(p);
    for (int i = 0; i < 4; ++i) CHECK(same_batch(second->next(3, 10), rest[size_t(i)]));
  }
}

TEST_CASE("shuffled rows are seeded windows: the same for a seed, different across seeds and splits", "[io]") {
  TempDir d;
  write_token_shard(d / "a.bin", range_u16(0, 2000));
  DataOptions o;
  o.spec = d / "a.bin";
  o.shuffle = true;
  o.seed = 3;
  auto a = open_dataset(o), b = open_dataset(o);
  o.seed = 4;
  auto c = open_dataset(o);
  Batch ba = a->next(4, 16), bb = b->next(4, 16), bc = c->next(4, 16);
  CHECK(same_batch(ba, bb));
  CHECK_FALSE(same_batch(ba, bc));
  CHECK(a->position() == 4);  // rows drawn
  // rows, not batches: the next batch of 8 holds the rows two batches of 4 would hold
  Batch wide = b->next(8, 16), n1 = a->next(4, 16), n2 = a->next(4, 16);
  CHECK(row(wide.inputs, 0) == row(n1.inputs, 0));
  CHECK(row(wide.inputs, 7) == row(n2.inputs, 3));
  std::set<int64_t> starts;
  for (int64_t r = 0; r < 4; ++r) {
    auto in = row(ba.inputs, r), tg = row(ba.targets, r);
    starts.insert(in[0]);
    CHECK(in == range(in[0], in[0] + 16));  // a contiguous window of the stream
    CHECK(tg == range(in[0] + 1, in[0] + 17));
    CHECK(in[0] + 16 < 1800);  // within the train split (the last 10% is val)
  }
  CHECK(starts.size() > 1);
  o.split = Split::val;
  Batch v = open_dataset(o)->next(2, 16);
  for (int64_t r = 0; r < 2; ++r) CHECK(row(v.inputs, r)[0] >= 1800);
}

TEST_CASE("text dataset: bytes with vocab 256, the last val_fraction held out", "[io]") {
  TempDir d;
  const std::string p = d / "input.txt";
  std::string text;
  for (int i = 0; i < 1000; ++i) text.push_back(char('a' + i % 26));
  text[950] = char(0xE9);  // a byte above 127 stays itself
  write_bytes(p, text);
  DataOptions o;
  o.spec = p;
  auto train = open_dataset(o);
  CHECK(train->vocab_size() == 256);
  CHECK_THAT(train->describe(), Contains(p) && Contains("900 tokens"));
  Batch b = train->next(2, 5);
  CHECK(row(b.inputs, 1) == std::vector<int64_t>{'f', 'g', 'h', 'i', 'j'});
  CHECK(row(b.targets, 1) == std::vector<int64_t>{'g', 'h', 'i', 'j', 'k'});

  o.split = Split::val;
  auto val = open_dataset(o);
  Batch v = val->next(10, 9);  // 91 of the 100 held-out bytes
  std::vector<int64_t> want;
  for (int i = 900; i < 909; ++i) want.push_back(int64_t(uint8_t(text[size_t(i)])));
  CHECK(row(v.inputs, 0) == want);
  CHECK(to_vector<int64_t>(v.inputs)[50] == 0xE9);
  REQUIRE_THROWS_WITH(val->next(10, 10), Contains(p) && Contains("100 tokens") && Contains("B*T+1 = 101"));

  CHECK(train->encode("hé\n") == std::vector<int64_t>{'h', 0xC3, 0xA9, '\n'});
  CHECK(train->decode(train->encode("hé\n")) == "hé\n");

  o.spec = d / "missing.txt";
  REQUIRE_THROWS_WITH(open_dataset(o), Contains(o.spec));
  write_bytes(d / "empty.txt", "");
  o.spec = d / "empty.txt";
  REQUIRE_THROWS_WITH(open_dataset(o), Contains(o.spec) && Contains("empty"));
}

// ---- the synthetic task ----

TEST_CASE("synthetic task: token format, encode/decode and the spec", "[io]") {
  SyntheticTask task;
  CHECK(task.vocab_size() == 13);
  CHECK(task.problem_length() == 13);
  CHECK(task.decode(task.tokens({123, 45})) == "321+540=8610\n");
  CHECK(task.decode(task.tokens({999, 999})) == "999+999=8991\n");
  CHECK(task.encode("321+540=8610\n") == task.tokens({123, 45}));
  CHECK(task.decode(task.encode("0+9=\n")) == "0+9=\n");
  REQUIRE_THROWS_WITH(task.encode("1-2"), Contains("'-'"));
  CHECK(parse_synthetic_spec("synthetic:2").digits == 2);
  REQUIRE_THROWS_WITH(parse_synthetic_spec("synthetic:x"), Contains("synthetic:x"));
  REQUIRE_THROWS_WITH(parse_synthetic_spec("synthetic:19"), Contains("19 digits"));
  // A held-out pair is held out in both orders, so val never shows a commuted train problem.
  int64_t asymmetric = 0, held = 0;
  for (uint64_t a = 0; a < 1000; a += 7) {
    for (uint64_t b = 0; b < 1000; b += 13) {
      asymmetric += task.held_out({a, b}) != task.held_out({b, a});
      held += task.held_out({a, b});
    }
  }
  CHECK(asymmetric == 0);
  CHECK(held > 0.07 * 143 * 77);  // about a tenth
  CHECK(held < 0.13 * 143 * 77);
  // Even one-digit problems leave both splits non-empty.
  SyntheticTask one{1};
  CHECK(one.held_out(one.problem(Split::val, 0, 0)));
  CHECK_FALSE(one.held_out(one.problem(Split::train, 0, 0)));
}

TEST_CASE("synthetic batches: deterministic per seed, split-disjoint, targets only on answers", "[io]") {
  DataOptions o;  // spec "synthetic"
  o.seed = 11;
  auto a = open_dataset(o), b = open_dataset(o);
  o.seed = 12;
  auto c = open_dataset(o);
  o.seed = 11;
  o.split = Split::val;
  auto v = open_dataset(o);
  auto* task_ds = dynamic_cast<SyntheticDataset*>(a.get());
  REQUIRE(task_ds != nullptr);
  const SyntheticTask& task = task_ds->task();
  const int64_t B = 4, T = 40, L = task.problem_length(), P = task.prompt_length();

  Batch ba = a->next(B, T);
  CHECK(same_batch(ba, b->next(B, T)));
  CHECK_FALSE(same_batch(ba, c->next(B, T)));
  Batch bv = v->next(B, T);
  CHECK_FALSE(same_batch(ba, bv));

  for (const auto& [batch, split] : {std::pair{ba, Split::train}, std::pair{bv, Split::val}}) {
    for (int64_t r = 0; r < B; ++r) {
      auto in = row(batch.inputs, r), tg = row(batch.targets, r);
      for (int64_t t = 0; t < T; ++t) {
        const bool answer = (t + 1) % L >= P;
        CHECK((tg[size_t(t)] != -1) == answer);
        if (answer && t + 1 < T) CHECK(tg[size_t(t)] == in[size_t(t + 1)]);
      }
      for (int64_t s = 0; s + L <= T; s += L) {  // every whole problem is a correct sum in its split
        std::vector<int64_t> prob(in.begin() + s, in.begin() + s + L);
        const std::string text = task.decode(prob);
        SyntheticTask::Problem p{lsb_first(text.substr(0, 3)), lsb_first(text.substr(4, 3))};
        CHECK(task.tokens(p) == prob);
        CHECK(task.held_out(p) == (split == Split::val));
      }
    }
  }
  // Resume: the position is the number of rows drawn, so a resume at another batch size goes on
  // with the next row.
  CHECK(a->position() == B);
  Batch second = a->next(B, T);
  b->set_position(B);
  CHECK(same_batch(b->next(B, T), second));
  Batch third = a->next(B, T);
  b->set_position(B);
  Batch both = b->next(2 * B, T);
  for (int64_t r = 0; r < B; ++r) {
    CHECK(row(both.inputs, r) == row(second.inputs, r));
    CHECK(row(both.inputs, B + r) == row(third.inputs, r));
  }
  REQUIRE_THROWS_WITH(a->next(B, 12), Contains("T=12") && Contains("13 tokens"));
}

TEST_CASE("synthetic accuracy: 1 for an oracle, 0 for a constant model", "[io]") {
  SyntheticTask task;
  const int64_t Vp = 16;  // padded vocabulary: the extra columns must never win
  int calls = 0;
  LogitsFn oracle = [&](const Tensor& idx) {
    ++calls;
    const int64_t B = idx.size(0), len = idx.size(1);
    std::vector<int64_t> ids = to_vector<int64_t>(idx);
    std::vector<float> logits(size_t(B * len * Vp), 0.0f);
    for (int64_t i = 0; i < B; ++i) {
      std::vector<int64_t> seq(ids.begin() + i * len, ids.begin() + (i + 1) * len);
      const std::string s = task.decode(seq);
      SyntheticTask::Problem p{lsb_first(s.substr(0, 3)), lsb_first(s.substr(4, 3))};
      const int64_t next = task.answer(p)[size_t(len - task.prompt_length())];
      float* last = logits.data() + (i * len + len - 1) * Vp;
      last[next] = 5.0f;
      last[14] = 9.0f;  // padding column
    }
    return from_vector(logits, {B, len, Vp});
  };
  CHECK(synthetic_accuracy(task, oracle, 100, 64, 5) == 1.0);
  CHECK(calls == 2 * task.answer_length());  // 100 problems in two batched calls per answer token

  LogitsFn constant = [&](const Tensor& idx) { return zeros({idx.size(0), idx.size(1), Vp}); };
  CHECK(synthetic_accuracy(task, constant, 20, 64, 5) == 0.0);

  auto lines = synthetic_examples(task, oracle, 3, 64, 5);
  REQUIRE(lines.size() == 3);
  CHECK_THAT(lines[0], Contains("=") && Contains("  ok"));
  CHECK_THAT(synthetic_examples(task, constant, 1, 64, 5)[0], Contains("=00000  want 8"));

  REQUIRE_THROWS_WITH(synthetic_accuracy(task, oracle, 10, 11, 5), Contains("12 tokens"));
  LogitsFn narrow_vocab = [&](const Tensor& idx) { return zeros({idx.size(0), idx.size(1), 5}); };
  REQUIRE_THROWS_WITH(synthetic_accuracy(task, narrow_vocab, 1, 64, 5), Contains("V >= 13"));
}

// GPT-2's byte-level BPE against the Python oracle (tests/golden/make_bpe_golden.py: GPT-2's
// pattern matched by the `regex` module, and a tokenizer of 355 merges learned on its corpus).
namespace {
std::string golden_bpe() { return std::string(SG_SOURCE_DIR) + "/tests/golden/bpe"; }
}  // namespace

TEST_CASE("GPT-2 tokenizer: pieces and ids equal the Python oracle's, and decode gives the text back", "[io][tokenizer]") {
  const Gpt2Tokenizer tok = Gpt2Tokenizer::load(golden_bpe());
  REQUIRE(tok.vocab_size() == 612);
  REQUIRE(tok.eot() == 611);
  const nlohmann::json cases = nlohmann::json::parse(read_bytes(golden_bpe() + "/cases.json"));
  REQUIRE(cases.size() == 20);
  size_t multi = 0;  // cases where a piece takes more than one token: the merges' order matters
  for (const auto& c : cases) {
    const std::string text = c["text"];
    INFO("text '" << text << "'");
    std::vector<std::string> pieces;
    for (size_t pos = 0;;) {  // the pattern runs between the end-of-text markers
      const size_t eot = text.find("<|endoftext|>", pos);
      for (auto& p : Gpt2Tokenizer::split(text.substr(pos, eot == std::string::npos ? eot : eot - pos))) pieces.push_back(p);
      if (eot == std::string::npos) break;
      pos = eot + 13;
    }
    CHECK(pieces == c["pieces"].get<std::vector<std::string>>());
    const std::vector<int64_t> ids = tok.encode(text);
    CHECK(ids == c["ids"].get<std::vector<int64_t>>());
    CHECK(tok.decode(ids) == text);
    if (ids.size() > pieces.size()) ++multi;
  }
  REQUIRE(multi >= 10);
}

TEST_CASE("GPT-2 tokenizer: any bytes, not UTF-8 included, encode and decode back unchanged", "[io][tokenizer]") {
  const Gpt2Tokenizer tok = Gpt2Tokenizer::load(golden_bpe());
  const std::vector<std::string> texts = {std::string("\xff\xfe bad \x80 lead", 14), std::string("a\0b", 3),
                                          "\xc3\x28 overlong \xc0\xaf surrogate \xed\xa0\x80 end \xf0\x9f",
                                          "the model learns\xe2\x80"};
  for (const std::string& t : texts) CHECK(tok.decode(tok.encode(t)) == t);
  uint64_t s = 88172645463325252ull;  // xorshift: 200 strings of random bytes, ASCII-heavy
  for (int k = 0; k < 200; ++k) {
    std::string t;
    for (int i = 0; i < 1 + k % 40; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      t += char(s % 3 ? 0x20 + s % 0x5F : s >> 8 & 0xFF);
    }
    INFO("case " << k);
    CHECK(tok.decode(tok.encode(t)) == t);
  }
  // invalid bytes stand alone in the "other" class, between the valid characters around them
  CHECK(Gpt2Tokenizer::split("ab\xff" "cd 1\x80") == std::vector<std::string>{"ab", "\xff", "cd", " 1", "\x80"});
}

TEST_CASE("GPT-2 tokenizer: a long text encoded in parts gives the ids of one encode", "[io][tokenizer]") {
  const Gpt2Tokenizer tok = Gpt2Tokenizer::load(golden_bpe());
  std::string text;
  const char* lines[] = {"The model learns, the model learns again\n", "\n\n  indented tokens'\n", " spaced\n",
                         "It's the pieces\t\n", "\xc3\xa9t\xc3\xa9 caf\xc3\xa9\n", "<|endoftext|>Numbers 1024\n"};
  for (int k = 0; k < 60; ++k) text += lines[k % 6];
  const std::vector<int64_t> whole = tok.encode(text);
  for (size_t chunk : {size_t(1), size_t(7), size_t(50), size_t(333), text.size()}) {
    INFO("chunk " << chunk);
    std::vector<size_t> done;
    CHECK(tok.encode_chunks(text, chunk, [&](size_t n) { done.push_back(n); }) == whole);
    REQUIRE(!done.empty());
    CHECK(done.back() == text.size());
    CHECK(std::is_sorted(done.begin(), done.end()));
    if (chunk <= 50) CHECK(done.size() >= 10);  // it did cut
  }
}

// A '\n' at the end of a longer whitespace run is its own piece when text follows ("x\n\ny": "\n",
// "\n") but not at the end of a part ("x\n\n": "\n\n"), and GPT-2's vocabulary has a token for
// "\n\n" (628): encode_chunks must not cut there. It did (found by tests/fuzz/gpt2_tokenizer.cpp;
// `shardgrad tokenize` then wrote 628 where GPT-2 has 198 198 at a 1 MiB part's end after a blank line).
TEST_CASE("GPT-2 tokenizer: parts are not cut after a newline that ends a run of whitespace", "[io][tokenizer]") {
  // bytes_to_unicode: '\r' (13) is U+010D, '\n' (10) U+010A, ' ' (32) U+0120
  const std::string vocab = R"({"x": 0, "y": 1, "\u010d": 2, "\u010a": 3, "\u010d\u010a": 4, "\u0120": 5,
                                "\u0120\u010a": 6, "\u010a\u010a": 7})";
  const Gpt2Tokenizer tok(vocab, "#version: 0.2\n\u010a \u010a\n\u010d \u010a\n\u0120 \u010a\n", "runs");
  REQUIRE(tok.encode("x\n\n") == std::vector<int64_t>{0, 7});        // "\n\n" ends the text: one piece, merged
  REQUIRE(tok.encode("x\n\ny") == std::vector<int64_t>{0, 3, 3, 1});  // "\n", "\n", then y
  for (const std::string text : {"x\n\ny\n\nx\ny", "x\r\ny\r\nx\r\ny", "x \ny \nx\ny", "x\r\n\nyx\n\n\ny"}) {
    INFO("text '" << text << "'");
    const std::vector<int64_t> whole = tok.encode(text);
    for (size_t chunk = 1; chunk <= text.size(); ++chunk) CHECK(tok.encode_chunks(text, chunk, [](size_t) {}) == whole);
  }
  // Parts end just before a line end that a visible character precedes: LF and CRLF text alike.
  for (const std::string text : {"x\ny\nx\ny", "x\r\ny\r\nx\r\ny", "x\n\ny\n\nx\n\ny"}) {
    INFO("text '" << text << "'");
    std::vector<size_t> ends;
    CHECK(tok.encode_chunks(text, 1, [&](size_t n) { ends.push_back(n); }) == tok.encode(text));
    CHECK(ends.size() == 4);
  }
}

TEST_CASE("GPT-2 tokenizer: bad files and ids are refused, naming the file and line", "[io][tokenizer]") {
  TempDir d;
  const std::string vocab = R"({"a": 0, "b": 1, "ab": 2})";
  REQUIRE_THROWS_WITH(Gpt2Tokenizer::load(d / "missing"), Contains("missing: expected a folder holding GPT-2's vocab.json"));
  REQUIRE_THROWS_WITH(Gpt2Tokenizer::load(d.path.string()), Contains("vocab.json"));
  write_bytes(d / "vocab.json", vocab);
  REQUIRE_THROWS_WITH(Gpt2Tokenizer::load(d.path.string()), Contains("merges.txt"));
  write_bytes(d / "merges.txt", "#version: 0.2\na b\n");
  const Gpt2Tokenizer ok = Gpt2Tokenizer::load(d.path.string());
  CHECK(ok.encode("abab") == std::vector<int64_t>{2, 2});
  CHECK(ok.eot() == -1);
  REQUIRE_THROWS_WITH(ok.encode("abc"), Contains("the symbol 'c' has no id in vocab.json"));
  REQUIRE_THROWS_WITH(ok.decode({0, 3}), Contains("token id 3 is outside its vocabulary of 3"));
  REQUIRE_THROWS_WITH(Gpt2Tokenizer("{\"a\": 0,", "", "t"), Contains("tokenizer t: vocab.json is not JSON"));
  REQUIRE_THROWS_WITH(Gpt2Tokenizer(R"({"a": 0, "b": 0})", "", "t"), Contains("has id 0 (ids must be 0..1, each once)"));
  REQUIRE_THROWS_WITH(Gpt2Tokenizer(R"({"a": 0, "b": 5})", "", "t"), Contains("token 'b' has id 5"));
  REQUIRE_THROWS_WITH(Gpt2Tokenizer(vocab, "#version: 0.2\na b\nab\n", "t"),
                      Contains("merges.txt line 3: 'ab' is not two symbols and one space"));
  REQUIRE_THROWS_WITH(Gpt2Tokenizer(vocab, "b a\n", "t"),
                      Contains("merges.txt line 1: the merge 'b a' makes 'ba', which vocab.json does not have"));
  // without "<|endoftext|>" in the vocabulary the marker is ordinary text
  const Gpt2Tokenizer bytes_only(R"({"<": 0, "|": 1, "e": 2, "n": 3, "d": 4, "o": 5, "f": 6, "t": 7, "x": 8, ">": 9})", "", "t");
  CHECK(bytes_only.encode("<|endoftext|>").size() == 13);
}

TEST_CASE("random data: seeded uniform ids of GPT-2's vocabulary, each row's targets its next ids, resumable", "[io]") {
  io::DataOptions o;
  o.spec = "random";
  o.seed = 4;
  auto a = io::open_dataset(o), b = io::open_dataset(o);
  CHECK(a->vocab_size() == 50257);
  CHECK(a->describe() == "random tokens (uniform over 50257 ids)");
  const io::Batch x = a->next(4, 300), y = b->next(4, 300);
  const std::vector<int64_t> in = to_vector<int64_t>(x.inputs), tgt = to_vector<int64_t>(x.targets);
  CHECK(in == to_vector<int64_t>(y.inputs));  // the same seed, the same ids
  std::set<int64_t> seen(in.begin(), in.end());
  CHECK(seen.size() > 1100);  // 1200 draws from 50257 ids: few repeats
  CHECK(*seen.begin() >= 0);
  CHECK(*seen.rbegin() < 50257);
  CHECK(*seen.rbegin() > 45000);  // the whole range is drawn, not its low ids
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t t = 0; t + 1 < 300; ++t) CHECK(tgt[size_t(r * 300 + t)] == in[size_t(r * 300 + t + 1)]);
  // A resumed cursor gives the batch the uninterrupted one gives; the val split is another stream.
  const std::vector<int64_t> second = to_vector<int64_t>(a->next(4, 300).inputs);
  b->set_position(4);  // rows
  CHECK(to_vector<int64_t>(b->next(4, 300).inputs) == second);
  o.split = io::Split::val;
  CHECK(to_vector<int64_t>(io::open_dataset(o)->next(4, 300).inputs) != in);
  o.spec = "random:7";
  auto small = io::open_dataset(o);
  for (int64_t v : to_vector<int64_t>(small->next(8, 50).inputs)) CHECK((v >= 0 && v < 7));
  small->restrict_vocab(3);
  for (int64_t v : to_vector<int64_t>(small->next(8, 50).inputs)) CHECK((v >= 0 && v < 3));
  CHECK_THROWS_WITH(small->encode("hi"), Catch::Contains("random tokens have no text"));
  o.spec = "random:1";
  CHECK_THROWS_WITH(io::open_dataset(o), Catch::Contains("random:V takes the vocabulary size"));
}

// ---- multiple-choice eval files (HellaSwag) ----

namespace {
ChoiceExample choice(int64_t label, std::vector<int32_t> ctx, std::vector<std::vector<int32_t>> ends) {
  ChoiceExample e;
  e.label = label;
  e.context = std::move(ctx);
  e.endings = std::move(ends);
  return e;
}
}  // namespace

TEST_CASE("eval files: written and read back, a prefix read alone, bad files refused naming the example", "[io]") {
  TempDir d;
  const std::vector<ChoiceExample> ex = {choice(1, {5, 6, 7}, {{1}, {2, 3}, {4, 4, 4}, {9}}),
                                         choice(0, {65534}, {{0, 1}, {2}}),
                                         choice(2, {8, 8}, {{3}, {3}, {3, 3, 3, 3, 3}})};
  const std::string f = d / "ok.bin";
  write_choice_file(f, ex);
  const std::string bytes = read_bytes(f);
  // the header, then example 0: marker, bytes (6 words, its context's 3, 4 endings' 1 + 2 + 3 + 1 and 4 lengths = 19 words)
  int32_t h[4];
  std::memcpy(h, bytes.data(), sizeof(h));
  CHECK((h[0] == 20240522 && h[1] == 1 && h[2] == 3));
  uint16_t w[3];
  std::memcpy(w, bytes.data() + 1024, sizeof(w));
  CHECK((w[0] == 65535 && w[1] == 2 * 20 && w[2] == 0));
  CHECK(h[3] == 2 * 20);  // the longest
  const auto back = read_choice_file(f);
  REQUIRE(back.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(back[i].label == ex[i].label);
    CHECK(back[i].context == ex[i].context);
    CHECK(back[i].endings == ex[i].endings);
  }
  CHECK(read_choice_file(f, 2).size() == 2);
  CHECK(read_choice_file(f, 9).size() == 3);
  // llm.c's two kinds of file, each read as the other, say what they are
  REQUIRE_THROWS_WITH(read_token_shard(f), Catch::Contains("magic number 20240522 is not 20240520") &&
                                               Catch::Contains(": it is an llm.c multiple-choice eval file"));
  write_token_shard(d / "tokens.bin", {1, 2, 3});
  REQUIRE_THROWS_WITH(read_choice_file(d / "tokens.bin"), Catch::Contains(": it is an llm.c token shard (train --data)"));

  auto bad = [&](const std::string& name, std::string b, const std::string& msg) {
    const std::string p = d / name;
    write_bytes(p, b);
    REQUIRE_THROWS_WITH(read_choice_file(p), Catch::Contains(p) && Catch::Contains(msg));
  };
  auto put16 = [](std::string b, size_t at, uint16_t v) {
    std::memcpy(b.data() + at, &v, 2);
    return b;
  };
  bad("short.bin", bytes.substr(0, 100), "shorter than the 1024-byte header");
  bad("magic.bin", std::string(4, 'x') + bytes.substr(4), "not an llm.c multiple-choice eval file");
  bad("version.bin", bytes.substr(0, 4) + std::string("\2\0\0\0", 4) + bytes.substr(8), "version 2 is not 1");
  bad("negative.bin", bytes.substr(0, 8) + std::string("\xff\xff\xff\xff", 4) + bytes.substr(12),
      "negative example count -1");
  bad("cut.bin", bytes.substr(0, bytes.size() - 2), "example 2 (byte ");
  bad("cut2.bin", bytes.substr(0, bytes.size() - 2), "the file ends inside it");
  bad("odd.bin", bytes + "x", "not a whole number of 16-bit words");
  bad("marker.bin", put16(bytes, 1024, 7), "example 0 (byte 1024): starts with 7, not the example marker 65535");
  bad("index.bin", put16(bytes, 1024 + 40 + 4, 5), "example 1 (byte 1064): its index says 5");
  bad("label.bin", put16(bytes, 1024 + 6, 4), "example 0 (byte 1024): label 4 with 4 endings");
  bad("size.bin", put16(bytes, 1024 + 2, 38), "says it is 38 bytes but its fields take 40");
  bad("empty.bin", put16(bytes, 1024 + 10, 0), "an empty context");
  bad("extra.bin", bytes + std::string(4, '\0'), "4 bytes after the last of its 3 examples");
  {  // a count the file cannot hold: refused at the end of the data, nothing reserved for the count
    std::string b = bytes;
    const int32_t many = INT32_MAX;
    std::memcpy(b.data() + 8, &many, 4);
    bad("count.bin", b, "example 3 (byte 1124): the file ends inside it (the header promises 2147483647 examples)");
  }
  // what the format cannot hold is refused when written
  REQUIRE_THROWS_WITH(write_choice_file(d / "x.bin", {choice(0, {65535}, {{1}})}),
                      Catch::Contains("example 0: context token 65535 is outside 0..65534"));
  REQUIRE_THROWS_WITH(write_choice_file(d / "x.bin", {choice(0, {1}, {{1}}), choice(3, {1}, {{1}, {2}})}),
                      Catch::Contains("example 1: label 3 with 2 endings"));
  CHECK(!fs::exists(d / "x.bin"));
}

TEST_CASE("eval rows: each ending after its context, targets only on the ending, long contexts cropped", "[io]") {
  const std::vector<ChoiceExample> ex = {choice(0, {10, 11, 12}, {{20}, {21, 22}}), choice(1, {1, 2, 3, 4, 5, 6}, {{7, 8, 9}, {7}})};
  const ChoiceRows r = choice_rows(ex, 0, 1, 16, 1);
  // rows [10 11 12 20] and [10 11 12 21 22] without their last token; padded to 4 positions
  CHECK(to_vector<int64_t>(r.inputs) == std::vector<int64_t>{10, 11, 12, 0, 10, 11, 12, 21});
  CHECK(to_vector<int64_t>(r.targets) == std::vector<int64_t>{-1, -1, 20, -1, -1, -1, 21, 22});
  CHECK(r.ending_tokens == std::vector<int64_t>{1, 2});
  const ChoiceRows m = choice_rows(ex, 0, 1, 16, 3);  // sequence parallelism over 3: 4 positions become 6
  CHECK(m.inputs.size(1) == 6);
  // block 5: the second example's rows keep 5 + 1 - 3 = 3 context tokens (the last ones)
  const ChoiceRows c = choice_rows(ex, 1, 1, 5, 1);
  CHECK(to_vector<int64_t>(c.inputs) == std::vector<int64_t>{4, 5, 6, 7, 8, 4, 5, 6, 0, 0});
  CHECK(to_vector<int64_t>(c.targets) == std::vector<int64_t>{-1, -1, 7, 8, 9, -1, -1, 7, -1, -1});
  // both examples in one batch: 4 rows
  CHECK(choice_rows(ex, 0, 2, 16, 1).inputs.size(0) == 4);
  REQUIRE_THROWS_WITH(choice_rows(ex, 1, 1, 2, 1), Catch::Contains("eval example 1: an ending of 3 tokens does not fit"));
}

TEST_CASE("eval scoring matches PyTorch on the golden tiny GPT: each ending's mean loss, both answers, cropped contexts", "[io][golden]") {
  const std::string dir = std::string(SG_SOURCE_DIR) + "/tests/golden/";
  const nlohmann::json want = nlohmann::json::parse(read_bytes(dir + "hellaswag_tiny.json"));
  const std::vector<ChoiceExample> ex = read_choice_file(dir + "hellaswag_tiny.bin");  // written by the Python script
  REQUIRE(ex.size() == want["examples"].size());
  for (size_t i = 0; i < ex.size(); ++i) {
    const auto& w = want["examples"][i];
    CHECK(ex[i].label == w["label"].get<int64_t>());
    CHECK(ex[i].context == w["context"].get<std::vector<int32_t>>());
    CHECK(ex[i].endings == w["endings"].get<std::vector<std::vector<int32_t>>>());
  }
  io::SafetensorsFile g = load_safetensors(dir + "gpt_tiny.safetensors");
  for (const char* pre : {"input.", "expected.", "grad.", "adamw.", "after_adamw."})
    for (auto it = g.tensors.begin(); it != g.tensors.end();) it = it->first.rfind(pre, 0) == 0 ? g.tensors.erase(it) : std::next(it);
  nn::GPTConfig cfg = nn::config_from_hf(g, 4);
  nn::GPT model(cfg);
  nn::load_hf_state(model, g);
  // 3 examples a forward (a batch holds rows of several lengths), and one at a time: the same
  for (int64_t per : {3, 1}) {
    INFO("examples per forward " << per);
    int64_t batches = 0;
    const ChoiceScore s = score_choices(ex, [&](const Tensor& idx) { return model.forward(idx); }, cfg.vocab_size,
                                        cfg.block_size, 1, per, [&](int64_t, int64_t) { ++batches; });
    CHECK(batches == (int64_t(ex.size()) + per - 1) / per);
    CHECK(s.examples == int64_t(ex.size()));
    CHECK(s.correct_norm == want["correct"].get<int64_t>());
    CHECK(s.correct_sum == want["correct_sum"].get<int64_t>());
    for (size_t i = 0; i < ex.size(); ++i) {
      const auto& w = want["examples"][i];
      INFO("example " << i);
      CHECK(s.chosen[i] == w["chosen"].get<int64_t>());
      CHECK(s.chosen_sum[i] == w["chosen_sum"].get<int64_t>());
      const auto ml = w["mean_loss"].get<std::vector<double>>();
      REQUIRE(s.mean_loss[i].size() == ml.size());
      for (size_t k = 0; k < ml.size(); ++k) CHECK(std::abs(s.mean_loss[i][k] - ml[k]) <= 1e-5 * ml[k]);
    }
  }
}

TEST_CASE("HellaSwag jsonl: the context as it is, each ending after a space, bad lines named", "[io]") {
  TempDir d;
  const std::string f = d / "h.jsonl";
  write_bytes(f, "{\"ctx\": \"ab\", \"endings\": [\"c\", \"dd\"], \"label\": 1, \"ind\": 4}\n\n"
                 "{\"ctx\": \"x\", \"endings\": [\"y\", \"z\", \"w\"], \"label\": 0}\n");
  // a byte encoder: each byte its id
  const auto bytes = [](const std::string& s) { return std::vector<int64_t>(s.begin(), s.end()); };
  const auto ex = hellaswag_from_jsonl(f, bytes);
  REQUIRE(ex.size() == 2);
  CHECK(ex[0].label == 1);
  CHECK(ex[0].context == std::vector<int32_t>{'a', 'b'});
  CHECK(ex[0].endings == std::vector<std::vector<int32_t>>{{' ', 'c'}, {' ', 'd', 'd'}});
  CHECK(ex[1].endings.size() == 3);
  auto bad = [&](const std::string& text, const std::string& msg) {
    write_bytes(f, text);
    REQUIRE_THROWS_WITH(hellaswag_from_jsonl(f, bytes), Catch::Contains(f) && Catch::Contains(msg));
  };
  bad("{\"ctx\": \"a\", \"endings\": [\"b\"], \"label\": 0}\n{\"ctx\": \"a\", \"endings\": [\"b\"]}\n",
      "line 2: no integer \"label\" (the test split has none: use the validation split, hellaswag_val.jsonl)");
  bad("{\"ctx\": \"a\", \"endings\": [\"b\"], \"label\": \"\"}\n", "line 1: no integer \"label\"");
  // Hugging Face datasets' copy holds the label as a string of digits
  write_bytes(f, "{\"ctx\": \"ab\", \"endings\": [\"c\", \"dd\"], \"label\": \"1\"}\n");
  CHECK(hellaswag_from_jsonl(f, bytes).at(0).label == 1);
  bad("{\"ctx\": \"a\", \"endings\": [\"b\"], \"label\": 1}\n", "line 1: label 1 with 1 endings");
  bad("{\"ctx\": \"a\", \"endings\": [], \"label\": 0}\n", "line 1: no \"endings\" list");
  bad("not json\n", "line 1: not JSON");
  bad("{\"ctx\": \"\", \"endings\": [\"b\"], \"label\": 0}\n", "line 1: an empty context");
}
