/* The recurrent scan's token loop for one sequence on the CPU, float32.
 *
 * The same recurrence as the PyTorch loop (ssm_kernels/scan/torch_kernel.py), token by token, so
 * a state after a token has the same bits in any pass. Built on first use by
 * ssm_kernels/scan/cpu_loop.py with the machine's C compiler; no fast-math: NaN and inf
 * propagate as in the PyTorch loop.
 *
 * Layouts (contiguous): x, z: (L, H, P); B, C: (L, H, N), gathered per head; D: (H, P) or NULL;
 * y: (L, H, P), written. dt (before its bias, softplus and clamp) and dt_bias (or NULL) come per
 * head or per row: with per_head, dt (L, H), dt_bias (H) and A (H) (Mamba-2: one dt' and one
 * decay per head and token); else dt (L, H, P), dt_bias (H, P), and A (H, N, P) when
 * a_per_state (Mamba-1), else (H, P). The state is held transposed, (H, N, P), so that every
 * step runs along P in vectors (y's sum over N included, in N's order): state_t (H, N, P), read
 * and written. Captures: ncap offsets in [0, L], ascending; capture i is the state after
 * cap_offsets[i] tokens, to cap_out[i] (H, N, P).
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__) && defined(__GLIBC__)
/* glibc's vector exp (libmvec), as math.h declares it under fast-math: the loops below call it on
 * whole vectors, the scalar expf on their remainders. Accurate to a few ulp; NaN and inf as expf. */
float expf(float) __attribute__((__simd__("notinbranch")));
#endif
#include <stdlib.h>
#include <string.h>

static inline float discretize(float v, const float* dt_bias, int64_t i, int softplus, float dt_min, float dt_max) {
    if (dt_bias) v += dt_bias[i];
    if (softplus && !(v > 20.0f)) v = log1pf(expf(v)); /* threshold 20, as torch's softplus; NaN stays NaN */
    return v < dt_min ? dt_min : (v > dt_max ? dt_max : v); /* a NaN passes through, as torch.clamp */
}

int ssm_scan_sequence(int64_t L, int64_t H, int64_t P, int64_t N, const float* x, const float* dt, const float* A,
                      int per_head, int a_per_state, const float* B, const float* C, const float* z, const float* D,
                      const float* dt_bias, int softplus, float dt_min, float dt_max, float* state_t, float* y,
                      int64_t ncap, const int64_t* cap_offsets, float* cap_out) {
    const int64_t size = H * N * P;
    float* scratch = malloc(4 * P * sizeof(float));
    if (!scratch) return 1;
    float *restrict d = scratch, *restrict dx = scratch + P, *restrict decay = scratch + 2 * P;
    float* restrict acc = scratch + 3 * P; /* y of a (token, head), summed over N in N's order */
    int64_t c = 0;
    for (int64_t t = 0; t <= L; t++) {
        for (; c < ncap && cap_offsets[c] == t; c++) memcpy(cap_out + c * size, state_t, size * sizeof(float));
        if (t == L) break;
        for (int64_t h = 0; h < H; h++) {
            const int64_t row = (t * H + h) * P;
            const float *xt = x + row, *Bt = B + (t * H + h) * N, *Ct = C + (t * H + h) * N;
            float* yt = y + row;
            if (per_head) {
                const float dh = discretize(dt[t * H + h], dt_bias, h, softplus, dt_min, dt_max);
                const float ah = expf(dh * A[h]);
                for (int64_t p = 0; p < P; p++) d[p] = dh, decay[p] = ah;
            } else {
                for (int64_t p = 0; p < P; p++) {
                    d[p] = discretize(dt[row + p], dt_bias, h * P + p, softplus, dt_min, dt_max);
                    if (!a_per_state) decay[p] = expf(d[p] * A[h * P + p]);
                }
            }
            for (int64_t p = 0; p < P; p++) dx[p] = d[p] * xt[p], acc[p] = 0.0f;
            float* restrict s = state_t + h * N * P;
            for (int64_t n = 0; n < N; n++, s += P) {
                const float b = Bt[n], cn = Ct[n];
                if (a_per_state) {
                    const float* restrict a = A + (h * N + n) * P;
#pragma omp simd
                    for (int64_t p = 0; p < P; p++) {
                        const float sp = s[p] * expf(d[p] * a[p]) + dx[p] * b;
                        s[p] = sp, acc[p] += sp * cn;
                    }
                } else {
#pragma omp simd
                    for (int64_t p = 0; p < P; p++) {
                        const float sp = s[p] * decay[p] + dx[p] * b;
                        s[p] = sp, acc[p] += sp * cn;
                    }
                }
            }
            for (int64_t p = 0; p < P; p++) {
                float out = acc[p];
                if (D) out += D[h * P + p] * xt[p];
                if (z) out *= z[row + p] / (1.0f + expf(-z[row + p]));
                yt[p] = out;
            }
        }
    }
    free(scratch);
    return 0;
}
