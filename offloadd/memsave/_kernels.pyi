"""Type stub for the torch extension built from csrc/memsave/ (memsave's kernels).

The module itself is empty: importing it registers the torch ops that
:class:`offloadd.memsave.kernels.Kernels` calls (tensors are contiguous CPU tensors)::

    torch.ops.offloadd_memsave.vectorised() -> bool      # the CPU has AVX2
    torch.ops.offloadd_memsave.relu_mask(x) -> (out, bits)
    torch.ops.offloadd_memsave.relu_mask_(x) -> bits     # x = relu(x)
    torch.ops.offloadd_memsave.pack_mask(t, positive: bool) -> bits
    torch.ops.offloadd_memsave.select_mask(grad, bits) -> Tensor
    torch.ops.offloadd_memsave.expand_mask(bits, size: list[int], dtype) -> Tensor
    torch.ops.offloadd_memsave.pool_compact(indices, planes: int, geometry: list[int], dtype)
    torch.ops.offloadd_memsave.pool_expand(offsets, planes: int, geometry: list[int])
    # autograd ops (Note [C++ functions] in offloadd/memsave/kernels.py):
    torch.ops.offloadd_memsave.relu_bits(x) -> Tensor
    torch.ops.offloadd_memsave.relu_bits_(x) -> Tensor
    torch.ops.offloadd_memsave.conv_selective(x, weight, bias, stride, padding, dilation,
                                              transposed, output_padding, groups) -> Tensor
"""
