#include "parallel/sharded_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/error.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "parallel/checkpoint.h"
#include "parallel/watchdog.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace sg::ckpt {

namespace {

constexpr const char* kFormat = "shardgrad-sharded";
constexpr int kVersion = 1;

// The dtype spellings of safetensors headers, which the index shares.
const std::pair<DType, const char*> kDtypes[] = {{DType::f32, "F32"},  {DType::f64, "F64"}, {DType::bf16, "BF16"},
                                                 {DType::f16, "F16"},  {DType::i32, "I32"}, {DType::i64, "I64"}};
const char* dtype_tag(DType t) {
  for (auto& [d, s] : kDtypes)
    if (d == t) return s;
  return "?";
}

std::string rank_file(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.safetensors", rank);
  return buf;
}
std::string rank_pieces_file(int rank) {  // a rank's piece list, merged into index.json by rank 0
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank_%05d.pieces.json", rank);
  return buf;
}

json read_json_file(const fs::path& p, const std::string& what) {
  std::ifstream f(p);
  SG_CHECK(f.good(), "checkpoint: cannot read ", what, " ", p.string());
  try {
    return json::parse(f);
  } catch (const std::exception& e) {
    throw Error(str("checkpoint: ", p.string(), " is not valid JSON: ", e.what()));
  }
}

// Absolute byte ranges of each tensor of a safetensors file this process has just written.
std::map<std::string, std::pair<int64_t, int64_t>> data_ranges(const std::string& path) {
  io::ReadFile f(path, "checkpoint");
  uint64_t n = 0;
  f.read_at(&n, 8, 0);
  SG_CHECK(n <= uint64_t(f.size() - 8), "checkpoint: ", path, " has a header longer than the file");
  std::string text(size_t(n), '\0');
  f.read_at(text.data(), text.size(), 8);
  std::map<std::string, std::pair<int64_t, int64_t>> out;
  const json header = json::parse(text);
  for (const auto& [k, v] : header.items()) {
    if (k == "__metadata__") continue;
    const auto& off = v.at("data_offsets");
    out[k] = {8 + int64_t(n) + off[0].get<int64_t>(), 8 + int64_t(n) + off[1].get<int64_t>()};
  }
  return out;
}

}  // namespace

// ---- save ----

void write_rank_shard(const std::string& run_dir, int64_t step, int rank, const std::vector<Piece>& mine) {
  check_step_is_new(run_dir, step);
  const fs::path tmp = temp_step_dir(run_dir, step);
  std::error_code ec;
  fs::create_directories(tmp, ec);  // every rank: whoever comes first creates it
  SG_CHECK(fs::is_directory(tmp), "checkpoint: cannot create ", tmp.string(), ": ", ec.message());
  io::NamedTensors tensors;
  std::map<std::string, int> count;
  json pieces = json::array();
  for (const Piece& p : mine) {
    SG_CHECK(p.data.defined() && p.data.dim() == 1, "checkpoint: a piece of '", p.name, "' is not a 1-D tensor");
    SG_CHECK(p.box.offset.size() == p.global_shape.size() && p.box.shape.size() == p.global_shape.size(),
             "checkpoint: a piece of '", p.name, "' has a box of another rank than ", shape_str(p.global_shape));
    SG_CHECK(p.flat_lo >= 0 && p.flat_lo + p.data.numel() <= p.box.numel(), "checkpoint: a piece of '", p.name,
             "' holds elements [", p.flat_lo, ", ", p.flat_lo + p.data.numel(), ") of a box of ", p.box.numel());
    if (p.data.numel() == 0) {  // no bytes, but the tensor is named (an empty tensor has only such pieces)
      pieces.push_back({{"name", p.name}, {"shape", p.global_shape}, {"dtype", dtype_tag(p.data.dtype())}, {"empty", true}});
      continue;
    }
    const std::string key = p.name + "#" + std::to_string(count[p.name]++);
    tensors.emplace_back(key, p.data);
    pieces.push_back({{"name", p.name},
                      {"shape", p.global_shape},
                      {"dtype", dtype_tag(p.data.dtype())},
                      {"key", key},
                      {"offset", p.box.offset},
                      {"box", p.box.shape},
                      {"flat_lo", p.flat_lo},
                      {"numel", p.data.numel()},
                      {"checksum", tensor_checksum(p.data)}});
  }
  const std::string file = rank_file(rank), path = (tmp / file).string();
  io::save_safetensors(path, tensors, {{"format", "shardgrad-sharded-rank"}, {"rank", std::to_string(rank)}});
  auto ranges = data_ranges(path);
  for (auto& p : pieces) {
    if (p.contains("empty")) continue;
    auto [b, e] = ranges.at(p["key"].get<std::string>());
    p["data_offsets"] = {b, e};
  }
  json listing = {{"file", file}, {"bytes", int64_t(fs::file_size(path))}, {"pieces", pieces}};
  io::write_text_atomic((tmp / rank_pieces_file(rank)).string(), "checkpoint", listing.dump());
}

std::string commit_sharded(const std::string& run_dir, int64_t step, int world, const json& state,
                           const std::map<std::string, std::string>& metadata, int keep) {
  const fs::path tmp = temp_step_dir(run_dir, step);
  json index = {{"format", kFormat}, {"version", kVersion}, {"step", step},   {"world", world},
                {"state", state},    {"metadata", metadata}, {"files", json::object()}, {"tensors", json::object()}};
  std::set<std::string> keep_files = {kShardedManifest};
  for (int r = 0; r < world; ++r) {
    const fs::path listing_path = tmp / rank_pieces_file(r);
    SG_CHECK(fs::exists(listing_path), "checkpoint: rank ", r, " did not write its shard (", listing_path.string(),
             " is missing); the checkpoint of step ", step, " is not committed");
    const json listing = read_json_file(listing_path, "the piece list of rank " + std::to_string(r));
    const std::string file = listing.at("file").get<std::string>();
    index["files"][file] = {{"bytes", listing.at("bytes")}};
    keep_files.insert(file);
    for (const auto& p : listing.at("pieces")) {
      const std::string name = p.at("name").get<std::string>();
      json& t = index["tensors"][name];
      if (t.is_null()) t = {{"shape", p.at("shape")}, {"dtype", p.at("dtype")}, {"pieces", json::array()}};
      SG_CHECK(t["shape"] == p.at("shape") && t["dtype"] == p.at("dtype"), "checkpoint: tensor '", name,
               "' is ", t["dtype"].get<std::string>(), " ", t["shape"].dump(), " in one rank's pieces but ",
               p.at("dtype").get<std::string>(), " ", p.at("shape").dump(), " in ", file);
      if (p.contains("empty")) continue;  // named, nothing to read
      json q = p;
      q.erase("name");
      q.erase("shape");
      q.erase("dtype");
      q["file"] = file;
      t["pieces"].push_back(q);
    }
  }
  // Paths and flags in the run state may hold bytes that are not UTF-8 (a Latin-1 file name): they
  // are written with U+FFFD in their place rather than fail the save after the training.
  const std::string text = index.dump(1, ' ', false, json::error_handler_t::replace);
  {  // the same checks a reader makes: gaps, overlaps and bad boxes are refused before the commit
    json s;
    std::map<std::string, std::string> m;
    std::map<std::string, ShardedCheckpoint::TensorRef> ts;
    std::map<std::string, int64_t> fb;
    parse_sharded_index(tmp.string(), text, s, m, ts, fb);
  }
  // Leftovers of an earlier attempt (a larger world, the piece lists) do not belong in the commit.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(tmp))
    if (!keep_files.count(e.path().filename().string())) fs::remove_all(e.path(), ec);
  io::write_text_atomic((tmp / kShardedManifest).string(), "checkpoint", text);  // the manifest: written last
  return commit_step_dir(run_dir, tmp.string(), step, keep);
}

namespace {
// The save in three phases (rank 0 makes the run directory; every rank writes its file; rank 0
// commits), each ended by agree(this rank failed), which returns whether any rank did: then every
// rank throws, the failed one its own error, so no rank waits for a commit that will not come or
// returns a step directory that does not exist.
std::string save_in_phases(const std::string& run_dir, int64_t step, const std::vector<Piece>& mine, const json& state,
                           const std::map<std::string, std::string>& metadata, int rank, int world,
                           const std::function<bool(bool)>& agree, int keep) {
  std::string error;
  auto phase = [&](const std::function<void()>& work) {
    try {
      work();
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!agree(!error.empty())) return;
    // The rank that failed reports first: the others' errors end the job (MPI_Abort), which could
    // take it down before its own message (a full disk, say) was printed.
    if (error.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    throw Error(!error.empty() ? error
                               : str("checkpoint: step ", step, " was not saved: another rank failed (its error is ",
                                     "in its own output); ", run_dir, " keeps the previous checkpoint"));
  };
  phase([&] {
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(run_dir, ec);
    SG_CHECK(fs::is_directory(run_dir), "checkpoint: cannot create ", run_dir, ": ", ec.message());
  });
  phase([&] {
    write_rank_shard(run_dir, step, rank, mine);
    parallel::maybe_inject_in_save(step);  // testing: this rank's files written, no manifest yet
  });
  std::string where = (fs::path(run_dir) / step_dir_name(step)).string();
  phase([&] {
    if (rank == 0) where = commit_sharded(run_dir, step, world, state, metadata, keep);
  });
  return where;
}
}  // namespace

std::string save_sharded(const std::string& run_dir, int64_t step, const std::vector<Piece>& mine, const json& state,
                         const std::map<std::string, std::string>& metadata, int rank, int world,
                         const std::function<void()>& barrier, int keep) {
  // A plain barrier cannot carry a failure: a rank's error stays its own.
  return save_in_phases(run_dir, step, mine, state, metadata, rank, world,
                        [&](bool failed) {
                          if (!failed) barrier();
                          return failed;
                        },
                        keep);
}

std::string save_sharded(const std::string& run_dir, int64_t step, const std::vector<Piece>& mine, const json& state,
                         const std::map<std::string, std::string>& metadata, comm::ProcessGroup& group, int keep) {
  parallel::watchdog::beat("the checkpoint save", step - 1);
  auto agree = [&](bool failed) {  // a barrier that also tells every rank whether any failed
    parallel::watchdog::Waiting w("the checkpoint barrier");
    Tensor flag = from_vector<int32_t>({failed ? 1 : 0}, {1});
    group.all_reduce(flag, comm::ReduceOp::max, comm::Sync::blocking);
    return item(flag) != 0;
  };
  return save_in_phases(run_dir, step, mine, state, metadata, group.rank(), group.size(), agree, keep);
}

// ---- the index ----

namespace {

int64_t get_count(const json& v, const std::string& where, const char* field) {
  SG_CHECK(v.contains(field), where, ": missing ", field);
  const json& x = v[field];
  SG_CHECK(x.is_number_unsigned() && x.get<uint64_t>() <= uint64_t(INT64_MAX), where, ": ", field, " ", x.dump(),
           " is not a non-negative integer");
  return x.get<int64_t>();
}

Shape get_dims(const json& v, const std::string& where, const char* field) {
  SG_CHECK(v.contains(field) && v[field].is_array(), where, ": ", field, " is not a list");
  SG_CHECK(v[field].size() <= 16, where, ": ", field, " has ", v[field].size(), " dims (at most 16)");
  Shape s;
  for (const auto& d : v[field]) {
    SG_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(INT64_MAX), where, ": ", field, " ",
             v[field].dump(), " is not a list of non-negative integers");
    s.push_back(d.get<int64_t>());
  }
  return s;
}

int64_t checked_numel(const Shape& s, const std::string& where) {
  int64_t n = 1;
  for (int64_t d : s) SG_CHECK(!__builtin_mul_overflow(n, d, &n), where, ": ", shape_str(s), " has too many elements");
  return n;
}

// A plain file name inside the checkpoint directory: nothing that could reach outside it.
bool plain_file_name(const std::string& f) {
  if (f.empty() || f.size() > 255 || f == "." || f == ".." || f[0] == '.') return false;
  for (char c : f)
    if (c == '/' || c == '\\' || c == '\0' || static_cast<unsigned char>(c) < 0x20) return false;
  return f.size() > 12 && f.compare(f.size() - 12, 12, ".safetensors") == 0;
}

bool boxes_intersect(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.shape.size(); ++d)
    if (a.offset[d] + a.shape[d] <= b.offset[d] || b.offset[d] + b.shape[d] <= a.offset[d]) return false;
  return true;
}

// The pieces of one tensor cover it exactly once: in each box the flat runs tile the box, the
// boxes do not intersect, and their sizes add up to the tensor's.
void check_cover(const std::string& name, const ShardedCheckpoint::TensorRef& t) {
  std::map<std::pair<Shape, Shape>, std::vector<const ShardedCheckpoint::PieceRef*>> by_box;
  for (const auto& p : t.pieces) by_box[{p.box.offset, p.box.shape}].push_back(&p);
  std::vector<Box> boxes;
  int64_t total = 0;
  for (auto& [key, ps] : by_box) {
    std::sort(ps.begin(), ps.end(), [](auto* a, auto* b) { return a->flat_lo < b->flat_lo; });
    int64_t at = 0;
    for (const auto* p : ps) {
      SG_CHECK(p->flat_lo >= at, "checkpoint: tensor '", name, "': the piece in ", p->file, " (elements [", p->flat_lo,
               ", ", p->flat_lo + p->numel, ") of the box at ", shape_str(key.first), ") overlaps another piece");
      SG_CHECK(p->flat_lo == at, "checkpoint: tensor '", name, "': elements [", at, ", ", p->flat_lo,
               ") of the box at ", shape_str(key.first), " of shape ", shape_str(key.second), " are in no piece");
      at += p->numel;
    }
    Box b{key.first, key.second};
    SG_CHECK(at == b.numel(), "checkpoint: tensor '", name, "': elements [", at, ", ", b.numel(), ") of the box at ",
             shape_str(key.first), " of shape ", shape_str(key.second), " are in no piece");
    for (const Box& o : boxes)
      SG_CHECK(!boxes_intersect(o, b), "checkpoint: tensor '", name, "': the boxes at ", shape_str(o.offset), " and ",
               shape_str(b.offset), " overlap");
    boxes.push_back(b);
    total += b.numel();
  }
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  SG_CHECK(total == n, "checkpoint: tensor '", name, "' of shape ", shape_str(t.shape), ": its pieces cover ", total,
           " of ", n, " elements");
}

}  // namespace

void parse_sharded_index(const std::string& dir, const std::string& text, json& state,
                         std::map<std::string, std::string>& metadata,
                         std::map<std::string, ShardedCheckpoint::TensorRef>& tensors,
                         std::map<std::string, int64_t>& file_bytes) {
  const std::string at = (fs::path(dir) / kShardedManifest).string();
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw Error(str("checkpoint: ", at, " is not valid JSON: ", e.what()));
  }
  SG_CHECK(j.is_object(), "checkpoint: ", at, " is not a JSON object");
  SG_CHECK(j.value("format", json()) == kFormat, "checkpoint: ", at, " is not a shardgrad sharded index (format ",
           j.value("format", json()).dump(), ")");
  SG_CHECK(j.value("version", json()) == kVersion, "checkpoint: ", at, " has version ", j.value("version", json()).dump(),
           "; this shardgrad reads version ", kVersion);
  SG_CHECK(j.contains("state") && j["state"].is_object(), "checkpoint: ", at, ": state is not an object");
  state = j["state"];
  metadata.clear();
  if (j.contains("metadata")) {
    SG_CHECK(j["metadata"].is_object(), "checkpoint: ", at, ": metadata is not an object");
    for (const auto& [k, v] : j["metadata"].items()) {
      SG_CHECK(v.is_string(), "checkpoint: ", at, ": metadata '", k, "' is not a string");
      metadata[k] = v.get<std::string>();
    }
  }
  SG_CHECK(j.contains("files") && j["files"].is_object(), "checkpoint: ", at, ": files is not an object");
  file_bytes.clear();
  for (const auto& [f, v] : j["files"].items()) {
    SG_CHECK(plain_file_name(f), "checkpoint: ", at, ": file '", f,
             "' is not a plain .safetensors name inside the checkpoint directory");
    SG_CHECK(v.is_object(), "checkpoint: ", at, ": file '", f, "' is not an object");
    file_bytes[f] = get_count(v, str("checkpoint: ", at, ": file '", f, "'"), "bytes");
  }
  SG_CHECK(j.contains("tensors") && j["tensors"].is_object(), "checkpoint: ", at, ": tensors is not an object");
  tensors.clear();
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ranges;  // bytes used, per file
  for (const auto& [name, v] : j["tensors"].items()) {
    const std::string where = str("checkpoint: ", at, ": tensor '", name, "'");
    SG_CHECK(v.is_object(), where, " is not an object");
    ShardedCheckpoint::TensorRef t;
    t.shape = get_dims(v, where, "shape");
    const int64_t numel = checked_numel(t.shape, where);
    SG_CHECK(v.contains("dtype") && v["dtype"].is_string(), where, ": dtype is not a string");
    bool known = false;
    for (auto& [d, s] : kDtypes)
      if (v["dtype"] == s) known = true, t.dtype = d;
    SG_CHECK(known, where, ": unknown dtype ", v["dtype"].dump());
    int64_t bytes = 0;  // every piece's byte count is within it: none overflows
    SG_CHECK(!__builtin_mul_overflow(numel, int64_t(dtype_size(t.dtype)), &bytes), where, ": ", shape_str(t.shape), " ",
             v["dtype"].get<std::string>(), " is more bytes than a file can hold");
    SG_CHECK(v.contains("pieces") && v["pieces"].is_array(), where, ": pieces is not a list");
    for (size_t i = 0; i < v["pieces"].size(); ++i) {
      const json& pj = v["pieces"][i];
      const std::string pw = str(where, " piece ", i);
      SG_CHECK(pj.is_object(), pw, " is not an object");
      ShardedCheckpoint::PieceRef p;
      SG_CHECK(pj.contains("file") && pj["file"].is_string(), pw, ": file is not a string");
      p.file = pj["file"].get<std::string>();
      SG_CHECK(file_bytes.count(p.file), pw, ": file '", p.file, "' is not listed in files");
      SG_CHECK(pj.contains("key") && pj["key"].is_string(), pw, ": key is not a string");
      p.key = pj["key"].get<std::string>();
      p.box.offset = get_dims(pj, pw, "offset");
      p.box.shape = get_dims(pj, pw, "box");
      SG_CHECK(p.box.offset.size() == t.shape.size() && p.box.shape.size() == t.shape.size(), pw, ": a box of rank ",
               p.box.shape.size(), " in a tensor of shape ", shape_str(t.shape));
      for (size_t d = 0; d < t.shape.size(); ++d)
        SG_CHECK(p.box.offset[d] <= t.shape[d] && p.box.shape[d] <= t.shape[d] - p.box.offset[d], pw, ": the box at ",
                 shape_str(p.box.offset), " of shape ", shape_str(p.box.shape), " does not fit in ", shape_str(t.shape),
                 " (file ", p.file, ")");
      p.flat_lo = get_count(pj, pw, "flat_lo");
      p.numel = get_count(pj, pw, "numel");
      const int64_t box_numel = p.box.numel();
      SG_CHECK(p.numel > 0 && p.flat_lo <= box_numel && p.numel <= box_numel - p.flat_lo, pw, ": elements [", p.flat_lo,
               ", ", p.flat_lo, " + ", p.numel, ") are not inside its box of ", box_numel, " (file ", p.file, ")");
      SG_CHECK(pj.contains("data_offsets") && pj["data_offsets"].is_array() && pj["data_offsets"].size() == 2, pw,
               ": data_offsets is not [begin, end]");
      const json& off = pj["data_offsets"];
      SG_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(), pw, ": data_offsets ", off.dump(),
               " is not [begin, end]");
      const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
      const uint64_t fb = uint64_t(file_bytes[p.file]);
      SG_CHECK(b <= e && e <= fb, pw, ": bytes [", b, ", ", e, ") lie outside ", p.file, " of ", fb, " bytes");
      SG_CHECK(e - b == uint64_t(p.numel) * dtype_size(t.dtype), pw, ": bytes [", b, ", ", e, ") of ", p.file,
               " do not hold ", p.numel, " ", dtype_tag(t.dtype), " elements");
      p.begin = int64_t(b);
      p.end = int64_t(e);
      SG_CHECK(pj.contains("checksum") && pj["checksum"].is_string() && pj["checksum"].get<std::string>().size() == 16,
               pw, ": checksum is not 16 hex digits");
      p.checksum = pj["checksum"].get<std::string>();
      ranges[p.file].emplace_back(p.begin, p.end);
      t.pieces.push_back(std::move(p));
    }
    check_cover(name, t);
    tensors.emplace(name, std::move(t));
  }
  // No two pieces share bytes: what a reader allocates is bounded by the files' sizes.
  for (auto& [f, rs] : ranges) {
    std::sort(rs.begin(), rs.end());
    for (size_t i = 1; i < rs.size(); ++i)
      SG_CHECK(rs[i].first >= rs[i - 1].second, "checkpoint: ", at, ": two pieces share bytes [", rs[i].first, ", ",
               std::min(rs[i].second, rs[i - 1].second), ") of ", f);
  }
}

// ---- reading ----

Tensor Checkpoint::tensor(const std::string& name) const {
  const Shape s = shape(name);
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  Tensor out = empty({n}, dtype(name));
  read(name, Box{Shape(s.size(), 0), s}, 0, out);
  return reshape(out, s);
}

ShardedCheckpoint::ShardedCheckpoint(const std::string& step_dir) {
  path_ = step_dir;
  const fs::path index = fs::path(step_dir) / kShardedManifest;
  SG_CHECK(fs::exists(index), "checkpoint: ", step_dir, " has no ", kShardedManifest);
  std::ifstream f(index, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  parse_sharded_index(step_dir, ss.str(), state_, metadata_, tensors_, file_bytes_);
}

std::string ShardedCheckpoint::missing_files() const {
  for (const auto& [file, bytes] : file_bytes_) {
    const fs::path f = fs::path(path_) / file;
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (ec) return str(f.string(), " is missing");
    if (int64_t(size) != bytes) return str(f.string(), " is ", size, " bytes but ", kShardedManifest, " records ", bytes);
  }
  return "";
}

std::string checkpoint_files_problem(const std::string& step_dir) {
  if (!is_sharded_checkpoint(step_dir)) {
    // a sharded save's pieces without their index: the index is what was lost
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(step_dir, ec))
      if (e.path().filename().string().rfind("rank_", 0) == 0)
        return str((fs::path(step_dir) / kShardedManifest).string(), " is missing");
    for (const char* f : {"model.safetensors", "optim.safetensors"})
      if (!fs::exists(fs::path(step_dir) / f)) return str((fs::path(step_dir) / f).string(), " is missing");
    return "";
  }
  try {
    return ShardedCheckpoint(step_dir).missing_files();
  } catch (const Error& e) {
    return e.what();
  }
}

const ShardedCheckpoint::TensorRef& ShardedCheckpoint::ref(const std::string& name) const {
  auto it = tensors_.find(name);
  SG_CHECK(it != tensors_.end(), "checkpoint: tensor '", name, "' is missing from ", path_);
  return it->second;
}

bool ShardedCheckpoint::has(const std::string& name) const { return tensors_.count(name) > 0; }
Shape ShardedCheckpoint::shape(const std::string& name) const { return ref(name).shape; }
DType ShardedCheckpoint::dtype(const std::string& name) const { return ref(name).dtype; }

std::vector<std::string> ShardedCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [n, _] : tensors_) out.push_back(n);
  return out;
}

// Only the pieces whose elements can meet the request are read (and checksummed): under a
// sharded layout a rank reads about its own share, not the whole tensor.
void ShardedCheckpoint::read(const std::string& name, const Box& box, int64_t flat_lo, const Tensor& out) const {
  if (cached_name_ == name) return cached_.read(name, box, flat_lo, out);  // assembled already
  const TensorRef& t = ref(name);
  const auto [lo, hi] = run_extent(t.shape, box, flat_lo, out.numel());
  if (pieces_name_ != name) {
    pieces_.clear();
    pieces_name_ = name;
  }
  int64_t copied = 0;
  for (const auto& p : t.pieces) {
    const auto [plo, phi] = run_extent(t.shape, p.box, p.flat_lo, p.numel);
    if (phi <= lo || hi <= plo) continue;
    const std::string id = p.file + "/" + p.key;  // keys repeat across the ranks' files
    auto it = pieces_.find(id);
    if (it == pieces_.end()) {
      io::ReadFile rf((fs::path(path_) / p.file).string(), "checkpoint");
      SG_CHECK(rf.size() == file_bytes_.at(p.file), "checkpoint: tensor '", name, "': file ", rf.path(), " is ",
               rf.size(), " bytes but index.json records ", file_bytes_.at(p.file), " (truncated or replaced?)");
      Tensor data = Tensor::empty({p.numel}, t.dtype, Device::cpu());
      rf.read_at(data.data_ptr(), size_t(p.end - p.begin), p.begin);
      SG_CHECK(bytes_checksum(data.data_ptr(), data.nbytes()) == p.checksum, "checkpoint: tensor '", name,
               "' (piece '", p.key, "') in ", rf.path(), " fails its checksum: the file is corrupt");
      it = pieces_.emplace(id, Piece{name, t.shape, p.box, p.flat_lo, data}).first;
    }
    copied += copy_overlap(it->second, box, flat_lo, out);
  }
  SG_CHECK(copied == out.numel(), "checkpoint: tensor '", name, "': the pieces hold ", copied, " of the ", out.numel(),
           " elements asked for");
}

Tensor ShardedCheckpoint::tensor(const std::string& name) const {
  load(name);
  const Tensor& t = cached_.tensors().at(name);
  Tensor out = empty(t.shape(), t.dtype());
  autograd::NoGradGuard ng;
  copy_(out, t);
  return out;
}

void ShardedCheckpoint::load(const std::string& name) const {
  if (cached_name_ == name) return;
  const TensorRef& t = ref(name);
  cached_ = MemorySource();
  cached_name_.clear();
  // Every file first: a truncated or replaced file is refused before anything is allocated.
  std::map<std::string, std::unique_ptr<io::ReadFile>> files;
  for (const auto& p : t.pieces) {
    if (files.count(p.file)) continue;
    auto rf = std::make_unique<io::ReadFile>((fs::path(path_) / p.file).string(), "checkpoint");
    SG_CHECK(rf->size() == file_bytes_.at(p.file), "checkpoint: tensor '", name, "': file ", rf->path(), " is ",
             rf->size(), " bytes but index.json records ", file_bytes_.at(p.file), " (truncated or replaced?)");
    files.emplace(p.file, std::move(rf));
  }
  std::vector<Piece> pieces;
  for (const auto& p : t.pieces) {
    Tensor data = Tensor::empty({p.numel}, t.dtype, Device::cpu());
    const io::ReadFile& rf = *files.at(p.file);
    rf.read_at(data.data_ptr(), size_t(p.end - p.begin), p.begin);
    SG_CHECK(bytes_checksum(data.data_ptr(), data.nbytes()) == p.checksum, "checkpoint: tensor '", name,
             "' (piece '", p.key, "') in ", rf.path(), " fails its checksum: the file is corrupt");
    pieces.push_back({name, t.shape, p.box, p.flat_lo, data});
  }
  // A tensor with no elements has no pieces with bytes: nothing to assemble.
  cached_.add(name, pieces.empty() ? Tensor::empty(t.shape, t.dtype, Device::cpu()) : assemble(pieces).at(name));
  cached_name_ = name;
}

// ---- the full format, as global tensors ----

namespace {

bool is_conv1d(const std::string& name) {  // stored [in, out] by Hugging Face, [out, in] here
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    const std::string suf(s);
    if (name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0) return true;
  }
  return false;
}

class FullCheckpoint : public Checkpoint {
 public:
  explicit FullCheckpoint(const std::string& dir) {
    LoadedCheckpoint c = load_checkpoint(dir);
    path_ = c.path;
    state_ = c.state;
    state_.erase("checksums");
    metadata_ = c.model.metadata;
    autograd::NoGradGuard ng;
    const std::string pre = "transformer.";
    int64_t vocab = -1;
    for (const auto& [n0, t] : c.model.tensors) {
      const std::string n = n0.rfind(pre, 0) == 0 ? n0.substr(pre.size()) : n0;
      if (n.find(".attn.bias") != std::string::npos || n.find(".attn.masked_bias") != std::string::npos ||
          n == "lm_head.weight")
        continue;  // buffers and the tied head are not state
      if (n == "wte.weight") vocab = t.size(0);
      src_.add(n, is_conv1d(n) ? contiguous(transpose(t, 0, 1)) : t);
    }
    for (const auto& [n, t] : c.optim.tensors) {
      // Optimizer state of wte has the padded rows of the live parameter; the global tensor does not.
      const bool wte = n.rfind("wte.weight.", 0) == 0;
      src_.add(n, wte && vocab >= 0 && t.size(0) > vocab ? contiguous(narrow(t, 0, 0, vocab)) : t);
    }
  }
  bool has(const std::string& name) const override { return src_.has(name); }
  Shape shape(const std::string& name) const override { return src_.shape(name); }
  void read(const std::string& name, const Box& box, int64_t flat_lo, const Tensor& out) const override {
    src_.read(name, box, flat_lo, out);
  }
  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& [n, _] : src_.tensors()) out.push_back(n);
    return out;
  }
  DType dtype(const std::string& name) const override {
    SG_CHECK(src_.has(name), "checkpoint: tensor '", name, "' is missing from ", path_);
    return src_.tensors().at(name).dtype();
  }

 private:
  MemorySource src_;
};

}  // namespace

std::unique_ptr<Checkpoint> open_checkpoint(const std::string& dir, bool report_skipped) {
  const std::string step = resolve_checkpoint(dir, report_skipped);
  if (is_sharded_checkpoint(step)) return std::make_unique<ShardedCheckpoint>(step);
  return std::make_unique<FullCheckpoint>(step);
}

bool is_optimizer_state(const std::string& name) {
  for (const char* s : {".exp_avg", ".exp_avg_sq", ".master"}) {
    const std::string suf(s);
    if (name.size() > suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0) return true;
  }
  return false;
}

io::NamedTensors hf_model_tensors(const Checkpoint& c) {
  autograd::NoGradGuard ng;
  io::NamedTensors out;
  for (const auto& name : c.names()) {
    if (is_optimizer_state(name)) continue;
    Tensor t = c.tensor(c.has(name + ".master") ? name + ".master" : name);
    out.emplace_back(name, is_conv1d(name) ? contiguous(transpose(t, 0, 1)) : t);
  }
  return out;
}

}  // namespace sg::ckpt
