#include "parallel/dp.h"

#include <omp.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "autograd/ops.h"
#include "autograd/tape.h"
#include "core/trace.h"

namespace sg::parallel {

std::vector<Device> parse_devices(const std::string& list) {
  std::vector<Device> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    SG_CHECK(b != std::string::npos, "--devices ", list, ": an empty entry (expected cpu:N or cuda:N, comma-separated)");
    try {
      out.push_back(parse_device(item.substr(b, e - b + 1)));
    } catch (const Error& err) {
      throw Error(str("--devices ", list, ": ", err.what()));
    }
  }
  SG_CHECK(!out.empty(), "--devices: empty list");
  SG_CHECK(list.empty() || list.back() != ',', "--devices ", list, ": an empty entry after the last comma");
  for (size_t i = 0; i < out.size(); ++i)
    for (size_t j = 0; j < i; ++j) SG_CHECK(out[i] != out[j], "--devices: ", out[i].str(), " is listed twice");
  return out;
}

DataParallel::DataParallel(nn::GPT& model, std::vector<Device> devices) : model_(model), devices_(std::move(devices)) {
  SG_CHECK(model_.wte->weight.device() == devices_[0], "dp: the model must live on the first device ",
           devices_[0].str(), ", not ", model_.wte->weight.device().str());
}

double DataParallel::forward_backward(const Tensor& idx, const Tensor& targets, double scale) {
  const int64_t K = int64_t(devices_.size()), B = idx.size(0);
  SG_CHECK(B % K == 0, "dp: ", B, " rows do not split evenly over ", K, " devices");
  const int64_t rows = B / K;
  // Replicate: a fresh copy of every parameter on every other device, for this step only.
  std::vector<std::unique_ptr<nn::GPT>> replicas(static_cast<size_t>(K));
  std::vector<nn::GPT*> models(static_cast<size_t>(K));
  models[0] = &model_;
  for (int64_t k = 1; k < K; ++k) {
    replicas[size_t(k)] = std::make_unique<nn::GPT>(model_.config, model_.wte->weight.dtype(), devices_[size_t(k)]);
    replicas[size_t(k)]->recompute = model_.recompute;
    auto src = model_.named_parameters(), dst = replicas[size_t(k)]->named_parameters();
    for (size_t i = 0; i < src.size(); ++i) copy_(dst[i].second, src[i].second);
    models[size_t(k)] = replicas[size_t(k)].get();
  }
  // Forward in parallel, one tape per replica thread.
  std::vector<std::unique_ptr<autograd::Tape>> tapes(static_cast<size_t>(K));
  std::vector<Tensor> logits(static_cast<size_t>(K));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(K));
  // A new thread starts with OpenMP's default team size (every core), not the caller's: the
  // replicas share the caller's threads instead (on 2 cores, 2 replicas of 2 threads each ran 5x
  // slower than one process alone).
  const int threads = std::max(1, omp_get_max_threads() / int(K));
  auto run = [&](auto&& body) {
    std::vector<std::thread> ts;
    for (int64_t k = 0; k < K; ++k)
      ts.emplace_back([&, k] {
        omp_set_num_threads(threads);
        try {
          body(k);
        } catch (...) {
          errors[size_t(k)] = std::current_exception();
        }
      });
    for (auto& t : ts) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  };
  const DropoutGenerator caller_rng = dropout_generator();  // each replica thread: its rows' place
  run([&](int64_t k) {
    dropout_generator() = caller_rng;
    dropout_generator().place.row0 += k * rows;
    tapes[size_t(k)] = std::make_unique<autograd::Tape>();
    autograd::TapeScope scope(*tapes[size_t(k)]);
    Tensor mine = to(narrow(idx, 0, k * rows, rows), devices_[size_t(k)]);
    logits[size_t(k)] = models[size_t(k)]->forward(mine);
  });
  trace::memory(devices_[0]);  // the first device's samples: the replicas' forwards held there
  // Gather the outputs on the first device and compute the loss there.
  std::vector<Tensor> gathered;
  for (int64_t k = 0; k < K; ++k) {
    Tensor g = autograd::detach(to(logits[size_t(k)], devices_[0]));
    g.set_requires_grad(true);
    gathered.push_back(g);
  }
  autograd::Tape head;
  Tensor loss;
  {
    autograd::TapeScope scope(head);
    CrossEntropyOptions o;
    o.vocab = model_.config.vocab_size;
    o.sum = true;
    o.scale = scale;
    loss = cross_entropy(cat(gathered, 0), to(targets, devices_[0]), o);
  }
  const double value = item(loss);
  head.backward(loss);
  // Scatter the output gradients back and run each replica's backward in parallel.
  run([&](int64_t k) {
    tapes[size_t(k)]->backward({logits[size_t(k)]}, {to(gathered[size_t(k)].grad(), devices_[size_t(k)])});
  });
  trace::memory(devices_[0]);
  // Sum the replicas' parameter gradients onto the first device.
  autograd::NoGradGuard ng;
  auto mine = model_.named_parameters();
  for (int64_t k = 1; k < K; ++k) {
    auto theirs = replicas[size_t(k)]->named_parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      Tensor g = theirs[i].second.grad();
      if (!g.defined()) continue;
      Tensor here = to(g, devices_[0]);
      if (mine[i].second.grad().defined()) {
        add_(mine[i].second.grad(), here);
      } else {
        MemScope scope(MemCategory::grad);
        mine[i].second.set_grad(clone(here));
      }
    }
  }
  trace::memory(devices_[0]);
  return value;
}

}  // namespace sg::parallel
