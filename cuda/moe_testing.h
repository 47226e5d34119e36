/*
 * moe_testing.h — test entry points for the MoE kernels in moe.cu.
 *
 * Each function allocates device buffers, copies the inputs, runs one launcher on a
 * private stream, synchronizes, copies the outputs back and frees everything (on every
 * path). It returns OG_OK, OG_E_INVALID_ARGUMENT (bad size, NULL pointer, expert id out of
 * range, top_k above what the kernels support) or OG_E_CUDA. It never prints or exits.
 *
 * Layouts are the device layouts of moe.cuh, padded on the host by the caller:
 *   gate_up_bf16 [E, 2*I, round_up(H, 8)]  bf16 bits; rows [0, I) gate, [I, 2I) up;
 *                                           pad columns must be zero
 *   down_bf16    [E, H, round_up(I, 8)]     bf16 bits; pad columns must be zero
 *   act          [top_k, I]                 fp32, unpadded
 * Outputs are uploaded before the launch with their incoming contents, so a caller that
 * poisons them (e.g. with NaN) sees any element the kernel failed to write.
 */
#ifndef ONEGRAPH_MOE_TESTING_H
#define ONEGRAPH_MOE_TESTING_H

#include <stdint.h>
#include "onegraph.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Softmax over logits[E], then the top_k experts: sel_out[top_k], w_out[top_k]. */
OG_API og_status og_test_moe_topk(const float *logits, int E, int top_k, int norm,
                                  int32_t *sel_out, float *w_out);

/* act_out[top_k, I] = silu(gate_e . x) * (up_e . x), e = sel[j]; x is [H] fp32. */
OG_API og_status og_test_moe_gate_up_swiglu(const uint16_t *gate_up_bf16, int E, int H, int I,
                                            const float *x, const int32_t *sel, int top_k,
                                            float *act_out);

/* x_inout[H] += sum_j w[j] * (down_{sel[j]} . act[j]) in selection order. */
OG_API og_status og_test_moe_down(const uint16_t *down_bf16, int E, int H, int I,
                                  const float *act, const int32_t *sel, const float *w,
                                  int top_k, float *x_inout);

/* The quantized experts (format OG_WEIGHTS_INT8 or OG_WEIGHTS_Q4), weights and scales as
 * og_set_weight takes them for every expert row, experts concatenated (onegraph.h "weight
 * formats"): gate_up rows [E * 2I] (per expert: I gate rows, then I up rows) of H columns,
 * down rows [E * H] of I columns; int8 data unpadded [rows, cols] + fp32 scales [rows]; q4 packed
 * [rows, ceil(cols / 32) * 16] + bf16 scale bits [rows, ceil(cols / 32)]. */
OG_API og_status og_test_moe_gate_up_swiglu_quant(int32_t format, const void *weights,
                                                  const void *scales, int E, int H, int I,
                                                  const float *x, const int32_t *sel, int top_k,
                                                  float *act_out);
OG_API og_status og_test_moe_down_quant(int32_t format, const void *weights, const void *scales,
                                        int E, int H, int I, const float *act, const int32_t *sel,
                                        const float *w, int top_k, float *x_inout);

#ifdef __cplusplus
}
#endif
#endif /* ONEGRAPH_MOE_TESTING_H */
