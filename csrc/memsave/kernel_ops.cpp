/*
 * memsave's kernels (kernels.cpp) as torch ops, torch.ops.offloadd_memsave.*, which the Kernels
 * class of offloadd/memsave/kernels.py calls; and the init of the extension module
 * offloadd.memsave._kernels, whose import registers them with the autograd ops of
 * autograd_ops.cpp:
 *
 *   vectorised() -> bool                         the CPU has AVX2 (else Python calls none)
 *   relu_mask(x) -> (out, bits)                  out = relu(x) as torch computes it, bits of
 *                                                !(out <= 0)
 *   relu_mask_(x) -> bits                        the same, out being x
 *   pack_mask(t, positive) -> bits               bits of t > 0 if positive, else of !(t <= 0)
 *   select_mask(grad, bits) -> out               float32 only: bit ? grad : +0
 *   expand_mask(bits, size, dtype) -> out        bit ? 1 : 0, a new tensor of size and dtype
 *   pool_compact(indices, planes, geometry, dtype) -> offsets   MaxPool's indices as offsets in
 *   pool_expand(offsets, planes, geometry) -> indices           their windows, and back
 *
 * x, t and grad are float32 or bfloat16, bits uint8 (bit i is bit i % 8 of byte i / 8), every
 * tensor a contiguous CPU tensor; each op checks what it is given before it reads raw memory.
 * geometry is the 18 integers in[3], out[3], kernel[3], stride[3], padding[3], dilation[3] of a
 * pool taken as 3d (offloadd/memsave/kernels.py, _pool_args); offsets are uint8, int16 or int32.
 *
 * They are registered as catch-all kernels, which run at autograd's dispatch key: memsave calls
 * them inside its own autograd functions, so they record no graph of their own.
 */
#include <Python.h>

#include "kernels.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

namespace {

using at::Tensor;

constexpr int kFloat32 = 0; /* the dtype codes of kernels.cpp */
constexpr int kBFloat16 = 1;

intptr_t address(const Tensor& t) { return reinterpret_cast<intptr_t>(t.data_ptr()); }

int64_t packed_bytes(int64_t n) { return (n + 7) / 8; }

void check_cpu(const Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "offloadd_memsave::", op, ": ", what,
              " must be a contiguous CPU tensor");
}

int mask_dtype(at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "offloadd_memsave::", op,
              ": float32 or bfloat16 only, not ", dtype);
  return dtype == at::kFloat ? kFloat32 : kBFloat16;
}

Tensor new_bits(const Tensor& like) {
  return at::empty({packed_bytes(like.numel())}, like.options().dtype(at::kByte));
}

void check_bits(const Tensor& bits, int64_t n, const char* op) {
  check_cpu(bits, op, "bits");
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.numel() >= packed_bytes(n),
              "offloadd_memsave::", op, ": bits must be uint8 with at least ", packed_bytes(n),
              " bytes for ", n, " elements, not ", bits.scalar_type(), " of ", bits.numel());
}

bool vectorised() { return offloadd_masks_vectorised() != 0; }

/* bfloat16: torch's relu, then its bits in one pass */
std::tuple<Tensor, Tensor> relu_mask(const Tensor& x) {
  check_cpu(x, "relu_mask", "x");
  int dtype = mask_dtype(x.scalar_type(), "relu_mask");
  Tensor bits = new_bits(x);
  Tensor out;
  if (dtype == kFloat32) {
    out = at::empty_like(x, at::MemoryFormat::Contiguous);
    offloadd_masks_relu_f32(address(x), address(out), address(bits), x.numel());
  } else {
    out = at::relu(x);
    offloadd_masks_pack(address(out), kBFloat16, 0, address(bits), x.numel());
  }
  return {out, bits};
}

Tensor relu_mask_(Tensor& x) {
  check_cpu(x, "relu_mask_", "x");
  int dtype = mask_dtype(x.scalar_type(), "relu_mask_");
  Tensor bits = new_bits(x);
  if (dtype == kFloat32) {
    offloadd_masks_relu_f32(address(x), address(x), address(bits), x.numel());
  } else {
    at::relu_(x);
    offloadd_masks_pack(address(x), kBFloat16, 0, address(bits), x.numel());
  }
  return bits;
}

Tensor pack_mask(const Tensor& t, bool positive) {
  check_cpu(t, "pack_mask", "t");
  int dtype = mask_dtype(t.scalar_type(), "pack_mask");
  Tensor bits = new_bits(t);
  offloadd_masks_pack(address(t), dtype, positive ? 1 : 0, address(bits), t.numel());
  return bits;
}

Tensor select_mask(const Tensor& grad, const Tensor& bits) {
  check_cpu(grad, "select_mask", "grad");
  TORCH_CHECK(grad.scalar_type() == at::kFloat,
              "offloadd_memsave::select_mask: float32 only, not ", grad.scalar_type());
  check_bits(bits, grad.numel(), "select_mask");
  Tensor out = at::empty_like(grad, at::MemoryFormat::Contiguous);
  offloadd_masks_select_f32(address(grad), address(bits), address(out), grad.numel());
  return out;
}

Tensor expand_mask(const Tensor& bits, at::IntArrayRef size, at::ScalarType dtype) {
  int code = mask_dtype(dtype, "expand_mask");
  Tensor out = at::empty(size, bits.options().dtype(dtype));
  check_bits(bits, out.numel(), "expand_mask");
  offloadd_masks_expand(address(bits), address(out), out.numel(), code);
  return out;
}

int offsets_type(at::ScalarType dtype) {
  if (dtype == at::kByte) return 0;
  if (dtype == at::kShort) return 1;
  TORCH_CHECK(dtype == at::kInt, "offloadd_memsave: pool offsets are uint8, int16 or int32, not ",
              dtype);
  return 2;
}

/* planes x out[0] x out[1] x out[2] must be the number of elements of t. */
void check_pool(const Tensor& t, int64_t planes, at::IntArrayRef geometry, const char* op) {
  check_cpu(t, op, "the indices or offsets");
  TORCH_CHECK(geometry.size() == 18, "offloadd_memsave::", op,
              ": geometry has 18 integers (in, out, kernel, stride, padding, dilation in 3d), not ",
              geometry.size());
  for (int64_t v : geometry) {
    TORCH_CHECK(v >= 0, "offloadd_memsave::", op, ": geometry ", geometry,
                " has a negative value");
  }
  TORCH_CHECK(planes >= 0 && planes * geometry[3] * geometry[4] * geometry[5] == t.numel(),
              "offloadd_memsave::", op, ": ", planes, " planes of ", geometry.slice(3, 3),
              " outputs are not the ", t.numel(), " elements given");
}

Tensor pool_compact(const Tensor& indices, int64_t planes, at::IntArrayRef geometry,
                    at::ScalarType dtype) {
  check_pool(indices, planes, geometry, "pool_compact");
  TORCH_CHECK(indices.scalar_type() == at::kLong,
              "offloadd_memsave::pool_compact: int64 indices, not ", indices.scalar_type());
  int otype = offsets_type(dtype);
  Tensor offsets = at::empty(indices.sizes(), indices.options().dtype(dtype));
  offloadd_pool_compact(address(indices), address(offsets), otype, planes,
                        reinterpret_cast<intptr_t>(geometry.data()));
  return offsets;
}

Tensor pool_expand(const Tensor& offsets, int64_t planes, at::IntArrayRef geometry) {
  check_pool(offsets, planes, geometry, "pool_expand");
  int otype = offsets_type(offsets.scalar_type());
  Tensor indices = at::empty(offsets.sizes(), offsets.options().dtype(at::kLong));
  offloadd_pool_expand(address(offsets), address(indices), otype, planes,
                       reinterpret_cast<intptr_t>(geometry.data()));
  return indices;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offloadd_memsave, m) {
  m.def("vectorised() -> bool", &vectorised);
  m.def("relu_mask(Tensor x) -> (Tensor, Tensor)", &relu_mask);
  m.def("relu_mask_(Tensor(a!) x) -> Tensor", &relu_mask_);
  m.def("pack_mask(Tensor t, bool positive) -> Tensor", &pack_mask);
  m.def("select_mask(Tensor grad, Tensor bits) -> Tensor", &select_mask);
  m.def("expand_mask(Tensor bits, int[] size, ScalarType dtype) -> Tensor", &expand_mask);
  m.def("pool_compact(Tensor indices, int planes, int[] geometry, ScalarType dtype) -> Tensor",
        &pool_compact);
  m.def("pool_expand(Tensor offsets, int planes, int[] geometry) -> Tensor", &pool_expand);
}

/* The extension module offloadd.memsave._kernels: empty; loading it registers the ops of this
 * file and of autograd_ops.cpp. */
extern "C" PyObject* PyInit__kernels(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                               "memsave's kernels and autograd ops: torch.ops.offloadd_memsave.*",
                               -1, nullptr};
  return PyModule_Create(&module);
}
