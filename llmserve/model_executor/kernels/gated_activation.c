/* act(gate) * up for whole rows of a prefill or op-by-op step, the activation decoder_step.c computes, so
 * that both round it alike; one pass, where PyTorch's silu and mul take two through a strided view. */
#include <omp.h>
#include <stdint.h>

#include "gated_activation.h"

/* h [rows, inter] = act(gate_up[:, :inter]) * gate_up[:, inter:], activation 0 SiLU, 1 tanh GELU; rows
 * split between the threads. */
void gated_activation(const float *gate_up, int64_t rows, int64_t inter, int64_t activation, float *h,
                      int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        gated_act(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, inter, activation, h + r * inter);
}
