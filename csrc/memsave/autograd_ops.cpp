/*
 * memsave's two hottest autograd functions as C++ torch ops: the ReLU that saves a bit mask and
 * the convolution that saves its input only for the weight's gradient (Note [C++ functions] in
 * offloadd/memsave/kernels.py).  Compiled with kernels.cpp into the extension module
 * offloadd.memsave._kernels, whose import registers them as torch.ops.offloadd_memsave.*:
 *
 *   relu_bits(x) -> out                   relu(x), saving the bits of !(out <= 0)
 *   relu_bits_(x) -> x                    the same in place
 *   conv_selective(x, weight, bias, stride, padding, dilation, transposed, output_padding,
 *                  groups) -> out        aten::convolution, saving x only if the weight's
 *                                         gradient will be computed
 *
 * Each is the Python autograd.Function of offloadd/memsave/pointwise.py and conv.py, op for op,
 * without Python: the same forward, the same tensors saved (as SavedVariables, which is what
 * save_for_backward makes: offloadd's saved-tensor hooks see them), the same backward ops on the
 * same arguments, so the same bits;
 * the tests compare both with plain PyTorch.  relu_bits takes what kernels.serves() accepts (a
 * non-empty contiguous float32 or bfloat16 CPU tensor; Python checks before calling); its
 * backward takes any gradient.  conv_selective runs on any device.
 *
 * They are written as PyTorch's generated autograd kernels are (VariableType): the forward runs
 * below autograd, then a Node with typed fields records the graph (set_history, or
 * rebase_history in place, with check_inplace and one version bump, as plain's relu_).  The
 * generic torch::autograd::Function costs more than the op itself on small tensors (a context
 * with a map of IValues, _wrap_outputs), several times what these typed Nodes cost
 * (docs/benchmarks/memsave_cppops_cpu-2core_2026-11-24.md).  Backward behaves as torch's
 * @once_differentiable: it computes under no_grad, and with create_graph=True its results carry
 * a DelayedError node, so a second differentiation raises torch's own message (Note [double
 * backward] in pointwise.py).
 * Forward-mode AD is refused, as a Python autograd.Function without jvp refuses it.
 */
#include "kernels.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using torch::dynamo::autograd::CompiledNodeArgs;

constexpr int kFloat32 = 0; /* the dtype codes of kernels.cpp */
constexpr int kBFloat16 = 1;

intptr_t address(const Tensor& t) { return reinterpret_cast<intptr_t>(t.data_ptr()); }

void refuse_forward_ad(const Tensor& t, const char* op) {
  TORCH_CHECK(!torch::autograd::isFwGradDefined(t), "offloadd memsave's ", op,
              " does not support forward-mode AD (it has no jvp); memsave the model only for "
              "reverse-mode training");
}

/* torch's once_differentiable for a C++ backward: `outputs` were computed under no_grad; with
 * grad mode on (create_graph=True) and a gradient that requires grad, they are returned through
 * a DelayedError node that raises if anything differentiates them again. */
variable_list once_differentiable(const Tensor& grad, variable_list outputs) {
  if (!at::GradMode::is_enabled() || !grad.requires_grad()) return outputs;
  for (Tensor& v : outputs) {
    if (v.defined()) {
      v = v.detach();
      v.set_requires_grad(true);
    }
  }
  auto error = c10::make_intrusive<torch::autograd::DelayedError>(
      "trying to differentiate twice a function that was marked with @once_differentiable",
      static_cast<int64_t>(outputs.size()));
  return (*error)(std::move(outputs));
}

/* 0 where the bit is clear, 1 where it is set: a new contiguous tensor of `sizes` and `dtype`. */
Tensor expand_bits(const Tensor& bits, at::IntArrayRef sizes, at::ScalarType dtype) {
  Tensor out = at::empty(sizes, bits.options().dtype(dtype));
  int code = dtype == at::kFloat ? kFloat32 : kBFloat16;
  offloadd_masks_expand(address(bits), address(out), out.numel(), code);
  return out;
}

/* ---- ReLU keeping bits ------------------------------------------------------------------ */

/* Compiled autograd asks every node to describe itself; these nodes cannot (their saved state is
 * not traceable), so they refuse by name and say what works: Note [compiled autograd] in
 * offloadd/memsave/kernels.py. */
[[noreturn]] static void refuse_compiled(const std::string& node) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      false, "offloadd memsave: compiled autograd cannot trace the native backward ", node,
      ". memsave uses its Python functions, which it traces, for a forward run while "
      "torch._dynamo.config.compiled_autograd is set; enable compiled autograd that way "
      "(not only around backward), or set OFFLOADD_MEMSAVE_KERNELS=0");
}

struct ReluBitsBackward : public Node {
  SavedVariable bits_;

  std::string name() const override { return "ReluBitsBackward"; }
  void compiled_args(CompiledNodeArgs&) const override { refuse_compiled(name()); }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    bits_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Tensor& grad = grads[0];
    if (!grad.defined() || !task_should_compute_output(0)) return {Tensor()};
    Tensor bits = bits_.unpack();
    Tensor gx;
    {
      at::NoGradGuard no_grad;
      if (grad.scalar_type() == at::kFloat && grad.is_cpu() && grad.is_contiguous()) {
        gx = at::empty_like(grad); /* threshold_backward's result in one pass */
        offloadd_masks_select_f32(address(grad), address(bits), address(gx), grad.numel());
      } else { /* written over the expanded mask, as pointwise.py does */
        Tensor passes = expand_bits(bits, grad.sizes(), grad.scalar_type());
        gx = at::threshold_backward_out(passes, grad, passes, 0);
      }
    }
    return once_differentiable(grad, {gx});
  }
};

/* relu(x) into `out` (x itself in place) and the bits of !(out <= 0); x as kernels.serves()
 * takes it.  Runs below autograd: nothing is recorded, no version is bumped. */
Tensor relu_and_bits(const Tensor& x, bool inplace, Tensor& bits) {
  at::AutoDispatchBelowADInplaceOrView below;
  int64_t n = x.numel();
  bits = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  if (x.scalar_type() == at::kFloat) { /* relu and its bits in one pass: Note [fused relu] */
    Tensor out = inplace ? x : at::empty_like(x);
    offloadd_masks_relu_f32(address(x), address(out), address(bits), n);
    return out;
  }
  /* bfloat16: torch's relu, then its bits in one pass */
  Tensor out = inplace ? at::relu_(const_cast<Tensor&>(x)) : at::relu(x);
  offloadd_masks_pack(address(out), kBFloat16, 0, address(bits), n);
  return out;
}

Tensor relu_bits(const Tensor& x) {
  refuse_forward_ad(x, "relu_bits");
  Tensor bits;
  Tensor out = relu_and_bits(x, false, bits);
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = c10::make_intrusive<ReluBitsBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->bits_ = SavedVariable(bits, false);
    torch::autograd::set_history(out, node);
  }
  return out;
}

Tensor& relu_bits_(Tensor& x) {
  refuse_forward_ad(x, "relu_bits_");
  bool requires_grad = torch::autograd::compute_requires_grad(x);
  torch::autograd::check_inplace(x, requires_grad);
  c10::intrusive_ptr<ReluBitsBackward> node;
  if (requires_grad) { /* x's edge as it was before the write */
    node = c10::make_intrusive<ReluBitsBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
  }
  Tensor bits;
  relu_and_bits(x, true, bits);
  torch::autograd::increment_version(x); /* once, as plain's relu_ */
  if (node) {
    node->bits_ = SavedVariable(bits, false);
    torch::autograd::rebase_history(x, node);
  }
  return x;
}

/* ---- convolution saving its input only for the weight's gradient -------------------------- */

struct ConvSelectiveBackward : public Node {
  SavedVariable x_; /* only if the weight's gradient is to be computed */
  SavedVariable weight_;
  std::vector<int64_t> x_sizes; /* for the stand-in otherwise: Note [placeholder] */
  at::TensorOptions x_options;
  std::optional<std::vector<int64_t>> bias_sizes;
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;

  std::string name() const override { return "ConvSelectiveBackward"; }
  void compiled_args(CompiledNodeArgs&) const override { refuse_compiled(name()); }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    weight_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Tensor& grad = grads[0];
    std::array<bool, 3> mask = {task_should_compute_output(0), task_should_compute_output(1),
                                bias_sizes.has_value() && task_should_compute_output(2)};
    if (!grad.defined() || !(mask[0] || mask[1] || mask[2])) return {Tensor(), Tensor(), Tensor()};
    Tensor x = x_.unpack();
    Tensor weight = weight_.unpack();
    std::tuple<Tensor, Tensor, Tensor> g;
    {
      at::NoGradGuard no_grad;
      if (!x.defined()) x = at::empty(x_sizes, x_options); /* read for its shape only */
      std::optional<at::IntArrayRef> bias_ref;
      if (bias_sizes) bias_ref = at::IntArrayRef(*bias_sizes);
      g = at::convolution_backward(grad, x, weight, bias_ref, stride, padding, dilation,
                                   transposed, output_padding, groups, mask);
    }
    auto& [gx, gw, gb] = g;
    return once_differentiable(grad, {gx, gw, gb});
  }
};

Tensor conv_selective(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                      at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                      bool transposed, at::IntArrayRef output_padding, int64_t groups) {
  refuse_forward_ad(x, "conv_selective");
  refuse_forward_ad(weight, "conv_selective");
  if (bias) refuse_forward_ad(*bias, "conv_selective");
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = at::convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                          groups);
  }
  if (!torch::autograd::compute_requires_grad(x, weight, bias)) return out;
  auto node = c10::make_intrusive<ConvSelectiveBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias)); /* bias: edge 2 */
  if (node->should_compute_output(1)) {
    node->x_ = SavedVariable(x, false); /* the weight's gradient reads it */
  } else {
    node->x_sizes = x.sizes().vec();
    node->x_options = x.options();
  }
  /* the weight always, as plain: a parameter (free to keep), and the kernel computing the
   * weight's gradient then sees its real layout */
  node->weight_ = SavedVariable(weight, false);
  if (bias && bias->defined()) node->bias_sizes = bias->sizes().vec();
  node->stride = stride.vec();
  node->padding = padding.vec();
  node->dilation = dilation.vec();
  node->transposed = transposed;
  node->output_padding = output_padding.vec();
  node->groups = groups;
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace

TORCH_LIBRARY(offloadd_memsave, m) {
  m.def("relu_bits(Tensor x) -> Tensor");
  m.def("relu_bits_(Tensor(a!) x) -> Tensor(a!)");
  m.def("conv_selective(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
        "int[] dilation, bool transposed, int[] output_padding, int groups) -> Tensor");
}

/* Autograd: the ops record their own graph; Python calls them only where one is built (a
 * tensor requires grad, grad mode on). */
TORCH_LIBRARY_IMPL(offloadd_memsave, Autograd, m) {
  m.impl("relu_bits", relu_bits);
  m.impl("relu_bits_", relu_bits_);
  m.impl("conv_selective", conv_selective);
}
