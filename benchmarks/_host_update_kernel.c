/* The host-update benchmark's peers (benchmarks/host_update.py), built with the system's
 * C compiler and loaded with ctypes; never part of the package.
 *
 * adamw_bf16: AdamW on float32 masters and moments for bfloat16 parameters, in one
 * in-place pass (ZeRO-Offload's CPU-Adam loop, without its threads): per parameter it
 * reads the bfloat16 gradient, mu, nu and the master, and writes mu, nu, the master and
 * the bfloat16 parameter: 28 bytes. Same math as optax.adamw on the master:
 *   mu' = b1 mu + (1 - b1) g;  nu' = b2 nu + (1 - b2) g^2
 *   m'  = m - lr ((mu' / c1) / (sqrt(nu' / c2) + eps) + wd m)
 * with c1 = 1 - b1^t, c2 = 1 - b2^t; bfloat16 rounded to nearest even. The loop is split
 * over OpenMP's threads (all the cores the process may use, or OMP_NUM_THREADS), as
 * CPU-Adam splits its tiles.
 *
 * triad: a = b + s c over float32 (STREAM's triad), on the same threads. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
  uint32_t u = ((uint32_t)h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

void adamw_bf16(int64_t n, const uint16_t *__restrict__ g, float *__restrict__ mu,
                float *__restrict__ nu, float *__restrict__ m, uint16_t *__restrict__ p,
                float lr, float b1, float b2, float eps, float wd, float c1, float c2) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float gi = from_bf16(g[i]);
    float a = b1 * mu[i] + (1.0f - b1) * gi;
    float b = b2 * nu[i] + (1.0f - b2) * gi * gi;
    mu[i] = a;
    nu[i] = b;
    float master = m[i];
    master -= lr * ((a / c1) / (sqrtf(b / c2) + eps) + wd * master);
    m[i] = master;
    p[i] = to_bf16(master);
  }
}

void triad(int64_t n, float *__restrict__ a, const float *__restrict__ b,
           const float *__restrict__ c, float s) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
