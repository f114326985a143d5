/*
 * The entry points of kernels.cpp, called by the torch ops of kernel_ops.cpp and by the
 * autograd functions of autograd_ops.cpp, all compiled into one extension module,
 * offloadd.memsave._kernels.  The comment at the top of kernels.cpp says what each computes;
 * addresses are a tensor's data_ptr() as integers, every tensor contiguous.
 */
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int offloadd_masks_vectorised(void);
void offloadd_masks_relu_f32(intptr_t x, intptr_t out, intptr_t bits, int64_t n);
void offloadd_masks_pack(intptr_t src, int dtype, int pred, intptr_t bits, int64_t n);
void offloadd_masks_select_f32(intptr_t grad, intptr_t bits, intptr_t out, int64_t n);
void offloadd_masks_expand(intptr_t bits, intptr_t out, int64_t n, int dtype);
void offloadd_pool_compact(intptr_t indices, intptr_t offsets, int otype, int64_t planes,
                           intptr_t geometry);
void offloadd_pool_expand(intptr_t offsets, intptr_t indices, int otype, int64_t planes,
                          intptr_t geometry);

#ifdef __cplusplus
}
#endif
