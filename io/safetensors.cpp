// safetensors, following the format's own rules (huggingface/safetensors): the header is JSON of at
// most 100 MB, padded with spaces to a multiple of 8; the tensors' byte ranges cover the data section
// exactly, without holes or overlaps. Nothing is allocated before the sizes it depends on have been
// checked against the file's length.
#include "io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "io/file.h"

namespace sg::io {

static_assert(std::endian::native == std::endian::little, "safetensors bytes are little-endian, as is this host");

namespace {

using ojson = nlohmann::ordered_json;

constexpr int64_t kMaxHeaderBytes = 100'000'000;  // the limit the reference implementation enforces
const char* const kMetadataKey = "__metadata__";
// Where a tensor not read lives: a meta device of its own, so that its bytes are charged to a
// ledger no report reads (meta:0 is a simulated rank's).
const Device kNotRead = Device::meta(3 << 20);

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
  }
  return "?";
}

bool parse_safetensors_dtype(const std::string& s, DType& out) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64}) {
    if (s == safetensors_dtype(t)) {
      out = t;
      return true;
    }
  }
  return false;
}

struct Entry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  int64_t begin = 0, end = 0;  // within the data section
};

}  // namespace

// ---- save ----

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  ojson header = ojson::object();
  if (!metadata.empty()) {
    ojson m = ojson::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header[kMetadataKey] = std::move(m);
  }
  std::set<std::string> seen;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    SG_CHECK(t.defined(), "safetensors ", path, ": tensor '", name, "' is undefined");
    SG_CHECK(name != kMetadataKey, "safetensors ", path, ": '", name, "' is reserved and cannot name a tensor");
    SG_CHECK(seen.insert(name).second, "safetensors ", path, ": tensor '", name, "' is listed twice");
    const int64_t nbytes = int64_t(t.nbytes());
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  // metadata may carry a path that is not UTF-8: U+FFFD in its place, not a save that fails
  std::string text = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  const uint64_t header_len = text.size();

  autograd::NoGradGuard no_grad;  // the copies below are I/O, not computation
  write_file_atomic(path, "safetensors", [&](const ByteSink& sink) {
    sink(&header_len, 8);
    sink(text.data(), text.size());
    for (const auto& [name, t] : tensors) {
      if (t.numel() == 0) continue;
      Tensor c = contiguous(to(t, Device::cpu()));  // one tensor at a time: at most one host copy alive
      sink(c.data_ptr(), c.nbytes());
    }
  });
}

// ---- load ----

const Tensor& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors.find(name);
  SG_CHECK(it != tensors.end(), "safetensors ", path, ": no tensor '", name, "' (the file holds ", tensors.size(), ")");
  return it->second;
}

namespace {

// Parses the header, rejecting any object that repeats a key (JSON parsers silently keep one).
ojson parse_header(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  auto callback = [&](int /*depth*/, ojson::parse_event_t ev, ojson& parsed) {
    if (ev == ojson::parse_event_t::object_start) keys.emplace_back();
    else if (ev == ojson::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    else if (ev == ojson::parse_event_t::key && !keys.empty() && !keys.back().insert(parsed.get<std::string>()).second &&
             duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  ojson j;
  try {
    j = ojson::parse(text, callback);
  } catch (const ojson::exception& e) {
    throw Error(str("safetensors ", path, ": the header is not valid JSON (", e.what(), ")"));
  }
  SG_CHECK(duplicate.empty(), "safetensors ", path, ": the header names '", duplicate, "' twice");
  SG_CHECK(j.is_object(), "safetensors ", path, ": the header is JSON but not an object");
  return j;
}

Entry parse_entry(const std::string& path, const std::string& name, const ojson& v, int64_t data_bytes) {
  const std::string where = str("safetensors ", path, ": tensor '", name, "'");
  SG_CHECK(v.is_object(), where, ": expected an object with dtype, shape and data_offsets");
  for (const auto& [k, _] : v.items())
    SG_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", where, ": unknown field '", k, "'");
  Entry e;
  e.name = name;

  SG_CHECK(v.contains("dtype"), where, ": missing dtype");
  SG_CHECK(v["dtype"].is_string(), where, ": dtype is not a string");
  const std::string dt = v["dtype"].get<std::string>();
  SG_CHECK(parse_safetensors_dtype(dt, e.dtype), where, ": unsupported dtype '", dt,
           "' (shardgrad reads F32, F64, BF16, F16, I32, I64)");

  SG_CHECK(v.contains("shape"), where, ": missing shape");
  SG_CHECK(v["shape"].is_array(), where, ": shape is not a list");
  int64_t numel = 1;
  for (const auto& d : v["shape"]) {
    SG_CHECK(d.is_number_unsigned(), where, ": shape ", v["shape"].dump(), " is not a list of non-negative integers");
    const uint64_t u = d.get<uint64_t>();
    SG_CHECK(u <= uint64_t(INT64_MAX), where, ": dimension ", u, " is too large");
    e.shape.push_back(int64_t(u));
    SG_CHECK(!__builtin_mul_overflow(numel, int64_t(u), &numel), where, ": shape ", v["shape"].dump(),
             " has more elements than fit in 64 bits");
  }
  int64_t nbytes = 0;
  SG_CHECK(!__builtin_mul_overflow(numel, int64_t(dtype_size(e.dtype)), &nbytes), where, ": shape ",
           v["shape"].dump(), " has more bytes than fit in 64 bits");

  SG_CHECK(v.contains("data_offsets"), where, ": missing data_offsets");
  const ojson& off = v["data_offsets"];
  SG_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(), where,
           ": data_offsets ", off.dump(), " is not [begin, end]");
  const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
  SG_CHECK(b <= en && en <= uint64_t(data_bytes), where, ": data_offsets [", b, ", ", en,
           "] do not lie within the data section of ", data_bytes, " bytes");
  e.begin = int64_t(b);
  e.end = int64_t(en);
  SG_CHECK(e.end - e.begin == nbytes, where, ": data_offsets [", b, ", ", en, "] hold ", e.end - e.begin,
           " bytes but ", dt, " ", shape_str(e.shape), " needs ", nbytes);
  return e;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path, const TensorFilter& want) {
  ReadFile f(path, "safetensors");
  const int64_t size = f.size();
  SG_CHECK(size >= 8, "safetensors ", path, ": the file is ", size, " bytes, shorter than the 8-byte header length");
  uint64_t header_len = 0;
  f.read_at(&header_len, 8, 0);
  // A header length past the limit or the file, with no JSON object after it: another kind of file
  // (a text, a token shard), said to be one rather than measured by its first 8 bytes.
  char opening = 0;
  if (size > 8) f.read_at(&opening, 1, 8);
  SG_CHECK(opening == '{' || (header_len <= uint64_t(kMaxHeaderBytes) && int64_t(header_len) <= size - 8), "safetensors ",
           path, ": not a safetensors file (no 8-byte header length followed by a JSON header)");
  SG_CHECK(header_len <= uint64_t(kMaxHeaderBytes), "safetensors ", path, ": header length ", header_len,
           " exceeds the 100 MB limit");
  SG_CHECK(int64_t(header_len) <= size - 8, "safetensors ", path, ": header length ", header_len,
           " is larger than the ", size - 8, " bytes after the length field (truncated file?)");
  std::string text(size_t(header_len), '\0');
  f.read_at(text.data(), text.size(), 8);
  const ojson header = parse_header(path, text);

  const int64_t data_start = 8 + int64_t(header_len);
  const int64_t data_bytes = size - data_start;
  SafetensorsFile out;
  out.path = path;
  std::vector<Entry> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == kMetadataKey) {
      SG_CHECK(v.is_object(), "safetensors ", path, ": __metadata__ is not an object of strings");
      for (const auto& [k, s] : v.items()) {
        SG_CHECK(s.is_string(), "safetensors ", path, ": __metadata__ value for '", k, "' is not a string");
        out.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, v, data_bytes));
    out.order.push_back(name);
  }

  // The byte ranges, in file order, must tile [0, data_bytes) exactly.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : by_offset) {
    SG_CHECK(e->begin >= covered, "safetensors ", path, ": tensor '", e->name, "' bytes [", e->begin, ", ", e->end,
             ") overlap tensor '", prev ? prev->name : "", "' bytes [", prev ? prev->begin : 0, ", ", covered, ")");
    SG_CHECK(e->begin == covered, "safetensors ", path, ": bytes [", covered, ", ", e->begin,
             ") of the data section belong to no tensor (a hole before tensor '", e->name, "')");
    covered = e->end;
    prev = e;
  }
  SG_CHECK(covered == data_bytes, "safetensors ", path, ": the last ", data_bytes - covered,
           " bytes of the data section belong to no tensor (file is ", size, " bytes, tensors end at ",
           data_start + covered, ")");

  for (const Entry& e : entries) {
    if (want && !want(e.name)) {
      out.tensors.emplace(e.name, Tensor::empty(e.shape, e.dtype, kNotRead));
      continue;
    }
    Tensor t = Tensor::empty(e.shape, e.dtype, Device::cpu());
    if (e.end > e.begin) f.read_at(t.data_ptr(), size_t(e.end - e.begin), data_start + e.begin);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

}  // namespace sg::io
