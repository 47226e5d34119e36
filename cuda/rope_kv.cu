// rope_kv.cu — the RoPE frequency table the engine uploads once. The per-head QK-norm, rotary
// embedding and KV-cache write run inside the body's attention kernel (rope_kv.cuh,
// attention.cu); rope_kv_testing.cu holds the same steps as a standalone kernel for the tests.
#include <math.h>

#include "kernels.cuh"

namespace og {

void rope_inv_freq(int head_dim, double theta, double linear_factor, float *inv_freq) {
    // Same steps as runtime/reference.py: float64 power, cast, then an fp32 division.
    const float factor = (float)linear_factor;
    for (int i = 0; i < head_dim / 2; ++i) {
        const double exponent = (double)(2 * i) / (double)head_dim;
        inv_freq[i] = (float)(1.0 / pow(theta, exponent)) / factor;
    }
}

}  // namespace og
