// Tensor: a cheap handle. Storage (bytes on a device) + Layout (shape, strides, offset, in
// elements) + dtype + autograd metadata. Views share the storage and never copy.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/storage.h"

namespace sg {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

struct Layout {
  Shape shape;
  Shape strides;
  int64_t offset = 0;
  int64_t numel() const { return shape_numel(shape); }
  bool is_contiguous() const;
};

namespace autograd {
struct Node;
}
struct TensorImpl;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialised memory, charged to the ledger category of the current MemScope.
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
  // Uninitialised host memory, page-locked when the CUDA backend is up (storage()->pinned()):
  // staging buffers and offloaded state that travel to and from a GPU. Plain host memory otherwise.
  static Tensor empty_pinned(const Shape& shape, DType dtype = DType::f32);
  // A new handle on the same bytes with another layout (no autograd edge: see sg::view ops).
  Tensor with_layout(const Layout& layout) const;

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  const Shape& shape() const;
  const Shape& strides() const;
  int64_t offset() const;
  const Layout& layout() const;
  int64_t dim() const { return int64_t(shape().size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  bool is_contiguous() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype()); }
  const std::shared_ptr<Storage>& storage() const;

  void* data_ptr() const;  // first element (storage + offset)
  template <class T>
  T* data() const {
    check_access(sizeof(T));
    return static_cast<T*>(data_ptr());
  }

  // Autograd metadata.
  bool requires_grad() const;
  Tensor& set_requires_grad(bool r);
  bool is_leaf() const;
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  int output_nr() const;
  // Fires once per backward, when the last consumer of this leaf on that tape has run.
  void add_grad_ready_hook(std::function<void(const Tensor&)> hook) const;
  const std::string& name() const;
  Tensor& set_name(std::string n);
  // The wrapper whose own step updates this parameter (a ZeroOptimizer, an FSDP), set while it
  // lives; empty: none. A plain optimizer refuses such a parameter: its gradient is sharded, freed
  // or only partly averaged there, so a second update would be silently wrong or do nothing.
  const std::string& updated_by() const;
  void set_updated_by(std::string who) const;

  std::string describe() const;  // "f32[2,3] on cpu"

 private:
  void check_access(size_t elem) const;
  std::shared_ptr<TensorImpl> impl_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Layout layout;
  DType dtype = DType::f32;
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;
  int output_nr = 0;
  std::vector<std::function<void(const Tensor&)>> grad_ready_hooks;
  // The ledger category of the .grad backward delivers to this leaf: grad, but activation for a
  // pipeline stage's received input, whose gradient is an activation's on its way upstream.
  MemCategory grad_category = MemCategory::grad;
  std::string name;
  std::string updated_by;
};

}  // namespace sg
