#include "core/tensor.h"

#include "core/error.h"

namespace sg {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

bool Layout::is_contiguous() const {
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != acc) return false;
    acc *= shape[i];
  }
  return true;
}

namespace {
template <class... Extra>
Tensor empty_on(const char* op, const Shape& shape, DType dtype, Device device, Extra... extra) {
  for (auto d : shape) SG_CHECK(d >= 0, op, ": negative dimension in shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(size_t(shape_numel(shape)) * dtype_size(dtype), device, MemScope::current(),
                                            extra...);
  impl->layout = Layout{shape, contiguous_strides(shape), 0};
  impl->dtype = dtype;
  return Tensor(impl);
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) { return empty_on("empty", shape, dtype, device); }

Tensor Tensor::empty_pinned(const Shape& shape, DType dtype) {
  return empty_on("empty_pinned", shape, dtype, Device::cpu(), Storage::Pinned{});
}

Tensor Tensor::with_layout(const Layout& layout) const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = impl_->storage;
  impl->layout = layout;
  impl->dtype = impl_->dtype;
  return Tensor(impl);
}

#define SG_NEED_IMPL SG_CHECK(impl_, "use of an undefined tensor")
const Shape& Tensor::shape() const { SG_NEED_IMPL; return impl_->layout.shape; }
const Shape& Tensor::strides() const { SG_NEED_IMPL; return impl_->layout.strides; }
int64_t Tensor::offset() const { SG_NEED_IMPL; return impl_->layout.offset; }
const Layout& Tensor::layout() const { SG_NEED_IMPL; return impl_->layout; }
int64_t Tensor::numel() const { return layout().numel(); }
DType Tensor::dtype() const { SG_NEED_IMPL; return impl_->dtype; }
Device Tensor::device() const { SG_NEED_IMPL; return impl_->storage->device(); }
bool Tensor::is_contiguous() const { return layout().is_contiguous(); }
const std::shared_ptr<Storage>& Tensor::storage() const { SG_NEED_IMPL; return impl_->storage; }

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  SG_CHECK(d >= -n && d < n, "size: dimension ", d, " out of range for shape ", shape_str(shape()));
  return shape()[size_t(d < 0 ? d + n : d)];
}

void* Tensor::data_ptr() const {
  SG_NEED_IMPL;
  void* base = impl_->storage->data();
  // A released storage (Storage::release: FSDP's parameters between their unit's uses) holds no
  // bytes; reading it would be a null dereference in some kernel, so say what it is instead.
  if (!base && impl_->storage->nbytes() == 0 && !impl_->storage->device().is_meta() && numel() > 0)
    throw Error(str("a ", dtype_name(impl_->dtype), " tensor of shape ", shape_str(shape()),
                    " is read while its storage is released (an FSDP unit's parameters outside its forward and "
                    "backward? The unit's forward must run through nn::Module::hooked; gather_all() brings them back)"));
  return static_cast<char*>(base) + impl_->layout.offset * int64_t(dtype_size(impl_->dtype));
}

void Tensor::check_access(size_t elem) const {
  SG_NEED_IMPL;
  SG_CHECK(elem == dtype_size(impl_->dtype), "data<T>: element size ", elem, " does not match dtype ",
           dtype_name(impl_->dtype));
}

bool Tensor::requires_grad() const { return impl_ && impl_->requires_grad; }
Tensor& Tensor::set_requires_grad(bool r) {
  SG_NEED_IMPL;
  SG_CHECK(!r || is_floating(impl_->dtype), "set_requires_grad: only floating tensors can require grad, got ",
           describe());
  impl_->requires_grad = r;
  return *this;
}
bool Tensor::is_leaf() const { SG_NEED_IMPL; return impl_->grad_fn == nullptr; }
Tensor Tensor::grad() const { SG_NEED_IMPL; return impl_->grad; }
void Tensor::set_grad(const Tensor& g) const { SG_NEED_IMPL; impl_->grad = g; }
const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const { SG_NEED_IMPL; return impl_->grad_fn; }
int Tensor::output_nr() const { SG_NEED_IMPL; return impl_->output_nr; }
void Tensor::add_grad_ready_hook(std::function<void(const Tensor&)> hook) const {
  SG_NEED_IMPL;
  impl_->grad_ready_hooks.push_back(std::move(hook));
}
const std::string& Tensor::name() const { SG_NEED_IMPL; return impl_->name; }
Tensor& Tensor::set_name(std::string n) { SG_NEED_IMPL; impl_->name = std::move(n); return *this; }
const std::string& Tensor::updated_by() const { SG_NEED_IMPL; return impl_->updated_by; }
void Tensor::set_updated_by(std::string who) const { SG_NEED_IMPL; impl_->updated_by = std::move(who); }

std::string Tensor::describe() const {
  if (!impl_) return "undefined";
  return str(dtype_name(dtype()), shape_str(shape()), " on ", device().str());
}

}  // namespace sg
