// moe.cuh — mixture-of-experts FFN kernels for the decode body (Qwen3-MoE).
//
// Per MoE layer the body runs, on the normed hidden state x_normed [hidden] fp32:
//   router GEMV (the dense bf16 GEMV over mlp.gate.weight [E, hidden]) -> router_logits [E]
//   launch_moe_topk                     -> selected_experts [top_k], selected_weights [top_k]
//   launch_moe_gate_up_swiglu           -> act [top_k, moe_inter]
//   launch_moe_down_weighted_residual   -> x [hidden] += weighted sum of the experts' outputs
// Expert ids and weights stay on the device; grids depend only on the config, so a
// captured graph replays unchanged whichever experts a token picks. Work scales with
// top_k, not with the number of experts.
//
// Weight layouts (bf16, rows padded with zeros to a multiple of 8 elements so every row
// starts 16-byte aligned):
//   gate_up_weights [E, 2 * moe_inter, round_up(hidden, 8)]: rows [0, I) = gate_proj,
//                                                            rows [I, 2I) = up_proj
//   down_weights    [E, hidden, round_up(moe_inter, 8)]
// Quantized experts (OG_WEIGHTS_INT8 / OG_WEIGHTS_Q4) keep the same row order, each row in the
// format's layout (quant.cuh) and the scales in the same row order:
//   gate_up  data [E * 2I rows, row_bytes(hidden)]     scales [E * 2I, scales_per_row(hidden)]
//   down     data [E * hidden rows, row_bytes(moe_inter)] scales [E * hidden, scales_per_row(moe_inter)]
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

constexpr int kMaxExperts = 512;   // launch_moe_topk: one warp, up to 16 logits per lane
constexpr int kMaxTopK = 32;       // one selected expert per lane of a warp

// Softmax over all E router logits (fp32, max subtracted), then the top_k largest
// probabilities in descending order; ties go to the lower expert index. When
// norm_topk_prob, the selected weights are divided by their sum. One small block.
cudaError_t launch_moe_topk(const float *router_logits, int num_experts, int top_k,
                            int norm_topk_prob, int32_t *selected_experts,
                            float *selected_weights, cudaStream_t stream, bool pdl = false);
// The same for n_rows rows at once (prefill): logits [n_rows, E] -> selected and weights
// [n_rows, top_k], one block per row.
cudaError_t launch_moe_topk_rows(const float *router_logits, int n_rows, int num_experts,
                                 int top_k, int norm_topk_prob, int32_t *selected_experts,
                                 float *selected_weights, cudaStream_t stream, bool pdl = false);

// act[j, i] = silu(gate_e[i] . x) * (up_e[i] . x),  e = selected_experts[j],
// for j < top_k, i < moe_inter; fp32 accumulation.
cudaError_t launch_moe_gate_up_swiglu(const __nv_bfloat16 *gate_up_weights,
                                      const float *x_normed, const int32_t *selected_experts,
                                      int top_k, int hidden, int moe_inter, float *act,
                                      cudaStream_t stream, bool pdl = false);

// For every row r < hidden:
//   y = 0; for j in 0..top_k-1 (selection order): y += selected_weights[j] * (down_e[r] . act[j])
//   x[r] += y
// The order of the weighted sum is fixed (selection order) so that the numpy reference,
// which sums in the same order, and graph replays agree.
cudaError_t launch_moe_down_weighted_residual(const __nv_bfloat16 *down_weights,
                                              const float *act,
                                              const int32_t *selected_experts,
                                              const float *selected_weights, int top_k,
                                              int hidden, int moe_inter, float *x,
                                              cudaStream_t stream, bool pdl = false);

// With pdl, every MoE kernel is launched with programmatic dependent launch: it waits on its
// predecessor (griddepcontrol.wait) before reading anything an earlier kernel wrote, so its
// launch overlaps the predecessor's tail.
// The two launchers above for any weight format. bf16 runs the kernels above; int8 / q4 run
// dequantizing kernels that compute the same sums up to rounding order:
//   gate_up: the dense quantized GEMV's tensor-core kernel (gemv.cu) over the selected
//            experts' rows: 16-row tasks (gate rows i..i+7 and up rows I+i..I+i+7 of one
//            selected expert), x as fp16 hi + lo, fp32 accumulation;
//   down:    a warp computes four rows r..r+3, walking the concatenation of the top_k experts'
//            rows as one long dot product against the concatenated act vectors, each 16-byte
//            chunk's partial sum scaled by selected_weights[j] * (row scale or group scale);
//            x[r] += the warp's sum.
cudaError_t launch_moe_gate_up_swiglu(const og::WeightMatrix &gate_up, const float *x_normed,
                                      const int32_t *selected_experts, int top_k, int hidden,
                                      int moe_inter, float *act, cudaStream_t stream, bool pdl);
cudaError_t launch_moe_down_weighted_residual(const og::WeightMatrix &down, const float *act,
                                              const int32_t *selected_experts,
                                              const float *selected_weights, int top_k,
                                              int hidden, int moe_inter, float *x,
                                              cudaStream_t stream, bool pdl);
