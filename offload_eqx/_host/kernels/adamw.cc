// AdamW on float32 masters in one in-place pass: offload_eqx's host update kernel.
//
// Registered with XLA as the FFI target "offload_eqx_adamw" on the CPU platform and
// called once per update from `offload_eqx/_optimizer/fused_adamw.py` with every leaf:
// operands `scalars`, then (g, m, mu, nu) per leaf; results (m', mu', nu', p') per leaf;
// attribute `flags`, one int8 per leaf (bit 0: weight decay applies; bit 1: XLA
// contracts its multiply-adds, `fma` below; bit 2: it contracts the gradient's product
// even where the gradient is widened). The caller
// computes every scalar (the reciprocals of the bias corrections, the learning rate of
// this step) with the same XLA operations optax's update compiles to.
//
// Per element, the float32 operations XLA:CPU compiles optax 0.2's adamw on a master m
// to (gradient g widened to float32), in the same order and with the same roundings:
//
//   a  = fma(g, k1, b1 mu)            (k1 = 1 - b1, rounded to float32 as optax's is;
//   b  = fma(g g, k2, b2 nu)           a gradient widened from bfloat16 or clipped in
//                                      the same loop: fma(mu, b1, k1 g) and
//                                      fma(nu, b2, (g g) k2))
//   u  = a / (c1 (sqrt(b / c2) + eps))  (c = 1 - beta^t, the bias corrections; XLA's
//                                      simplifier merges optax's two divisions into one)
//      = (a r1) / (sqrt(b r2) + eps)   where a single leaf is updated (r = 1 / c: XLA
//                                      rewrites a division by a bias correction used
//                                      once as a multiplication by its reciprocal;
//                                      sqrt(fma(b, r2, eps_root)) where eps_root != 0)
//   u  = fma(m, wd, u)                (only where weight decay applies)
//   m' = fma(u, step, m)              (step = -learning rate)
//   p' = m' rounded to the parameter's dtype (nearest even; NaN stays NaN)
//
// `fma` is one rounding: XLA:CPU lets LLVM contract a multiply feeding an add where the
// processor has fused multiply-add instructions, and these are the pairs it contracts
// (read from its object code: x86-64 with FMA, jaxlib 0.10.2 and 0.12.0.1). Where the
// processor has none, or the caller says XLA does not contract a leaf (its optimisations
// off: `--xla_backend_optimization_level=0`, where jaxlib 0.12 still contracts a
// rank-0 leaf, the gradient's product whatever its type: bit 2), XLA rounds every operation on its own, and so does this kernel: each
// `fma` above becomes a product and a sum, in that order. The file is compiled with
// -ffp-contract=off, so no contraction happens but these, written out; the variant is
// chosen when the library is loaded (`__builtin_cpu_supports`), not at build time, so
// one build serves every x86-64 processor.
//
// It reads g, m, mu and nu and writes m, mu, nu and p once: the new m, mu and nu alias
// the old (the caller declares it), so nothing is allocated but the parameter's result
// (which XLA places in the donated parameter's buffer where the step donates it).
//
// Every leaf is cut into chunks, and the calling thread and tasks on XLA's intra-op
// thread pool take chunks of all leaves from one counter: one call, however many leaves
// (a call per leaf cost its thread wake-ups per leaf: 192 small leaves ran 1.6x a fused
// C loop), and the call never waits on a task that has not started (no deadlock when
// every pool thread is busy).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements a task takes at a time

#define OX_INLINE inline __attribute__((always_inline))

OX_INLINE float FromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// As XLA:CPU converts: round to nearest even on the bits, a NaN kept quiet and signed.
OX_INLINE uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  uint32_t quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(f != f ? quiet : rounded);
}

// x y + z: one rounding where XLA contracts (kFused), else two.
template <bool kFused>
OX_INLINE float MulAdd(float x, float y, float z) {
  if constexpr (kFused) return __builtin_fmaf(x, y, z);
  else return x * y + z;
}

struct Scalars {
  float k1, b1, k2, b2, c1, c2, eps_root, eps, wd, step, merged, computed;
  float r1, r2;  // 1 / c1 and 1 / c2, as XLA computes them (one division each)
};

template <typename G, typename P, bool kDecay, bool kRoot, bool kMerged, bool kFused,
          bool kComputed>
OX_INLINE void Update(int64_t lo, int64_t hi, const G* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ mu, float* __restrict__ nu, P* __restrict__ p,
                      const Scalars s) {
  for (int64_t i = lo; i < hi; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) gi = FromBf16(g[i]); else gi = g[i];
    float a, b;
    // LLVM contracts the moment's product where the gradient is computed in the loop
    // (widened from bfloat16, or clipped), and the gradient's where it is loaded.
    if constexpr (kComputed) {
      a = MulAdd<kFused>(mu[i], s.b1, s.k1 * gi);
      b = MulAdd<kFused>(nu[i], s.b2, (gi * gi) * s.k2);
    } else {
      a = MulAdd<kFused>(gi, s.k1, s.b1 * mu[i]);
      b = MulAdd<kFused>(gi * gi, s.k2, s.b2 * nu[i]);
    }
    mu[i] = a;
    nu[i] = b;
    float master = m[i];
    float u;
    if constexpr (kMerged) {
      float root = kRoot ? b / s.c2 + s.eps_root : b / s.c2;
      u = a / (s.c1 * (std::sqrt(root) + s.eps));
    } else {
      float root = kRoot ? MulAdd<kFused>(b, s.r2, s.eps_root) : b * s.r2;
      u = (a * s.r1) / (std::sqrt(root) + s.eps);
    }
    if constexpr (kDecay) u = MulAdd<kFused>(master, s.wd, u);
    master = MulAdd<kFused>(u, s.step, master);
    m[i] = master;
    if constexpr (sizeof(P) == 2) p[i] = ToBf16(master); else p[i] = master;
  }
}

struct Leaf {
  const void* g;
  float *m, *mu, *nu;
  void* p;
  int64_t n;
  bool g_half, p_half, decay, contract, gradient_product;
};

template <typename G, typename P, bool kMerged, bool kFused, bool kComputed>
OX_INLINE void Rooted(const Leaf& l, int64_t lo, int64_t hi, const G* g, P* p,
                      const Scalars& s) {
  const bool root = s.eps_root != 0.0f;  // XLA drops an addition of zero
  if (l.decay && root) {
    Update<G, P, true, true, kMerged, kFused, kComputed>(lo, hi, g, l.m, l.mu, l.nu, p, s);
  } else if (l.decay) {
    Update<G, P, true, false, kMerged, kFused, kComputed>(lo, hi, g, l.m, l.mu, l.nu, p, s);
  } else if (root) {
    Update<G, P, false, true, kMerged, kFused, kComputed>(lo, hi, g, l.m, l.mu, l.nu, p, s);
  } else {
    Update<G, P, false, false, kMerged, kFused, kComputed>(lo, hi, g, l.m, l.mu, l.nu, p, s);
  }
}

template <typename G, typename P, bool kMerged, bool kFused>
OX_INLINE void Computed(const Leaf& l, int64_t lo, int64_t hi, const G* g, P* p,
                        const Scalars& s) {
  if (l.gradient_product) {
    Rooted<G, P, kMerged, kFused, false>(l, lo, hi, g, p, s);
  } else if (sizeof(G) == 2) {  // widened: computed in the loop either way
    Rooted<G, P, kMerged, kFused, true>(l, lo, hi, g, p, s);
  } else if (s.computed != 0.0f) {
    Rooted<G, P, kMerged, kFused, true>(l, lo, hi, g, p, s);
  } else {
    Rooted<G, P, kMerged, kFused, false>(l, lo, hi, g, p, s);
  }
}

template <typename G, typename P, bool kFused>
OX_INLINE void Typed(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  auto g = static_cast<const G*>(l.g);
  auto p = static_cast<P*>(l.p);
  if (s.merged != 0.0f) Computed<G, P, true, kFused>(l, lo, hi, g, p, s);
  else Computed<G, P, false, kFused>(l, lo, hi, g, p, s);
}

template <bool kFused>
OX_INLINE void ChunkOf(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  if (l.g_half && l.p_half) Typed<uint16_t, uint16_t, kFused>(l, lo, hi, s);
  else if (l.g_half) Typed<uint16_t, float, kFused>(l, lo, hi, s);
  else if (l.p_half) Typed<float, uint16_t, kFused>(l, lo, hi, s);
  else Typed<float, float, kFused>(l, lo, hi, s);
}

// One variant per kind of processor XLA:CPU compiles for differently. x86-64: with FMA
// (vectorised for AVX2, or AVX-512 where the processor has it) XLA contracts; without,
// it does not. Other processors with FMA in their base instruction set (AArch64) contract
// always. The vector width changes no result: every lane computes the same operations.
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
void ChunkAvx512(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  if (l.contract) ChunkOf<true>(l, lo, hi, s);
  else ChunkOf<false>(l, lo, hi, s);
}
__attribute__((target("avx2,fma,f16c")))
void ChunkAvx2(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  if (l.contract) ChunkOf<true>(l, lo, hi, s);
  else ChunkOf<false>(l, lo, hi, s);
}
void ChunkPlain(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  ChunkOf<false>(l, lo, hi, s);
}
using ChunkFn = void (*)(const Leaf&, int64_t, int64_t, const Scalars&);
ChunkFn Select() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma")) {
    return ChunkAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ChunkAvx2;
  return ChunkPlain;
}
const ChunkFn kChunkFn = Select();
const char* VariantName() {
  return kChunkFn == ChunkAvx512 ? "x86-64 AVX-512 with FMA"
       : kChunkFn == ChunkAvx2   ? "x86-64 AVX2 with FMA"
                                 : "x86-64 without FMA";
}
void Chunk(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) { kChunkFn(l, lo, hi, s); }
#elif defined(__aarch64__)
void Chunk(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  if (l.contract) ChunkOf<true>(l, lo, hi, s);
  else ChunkOf<false>(l, lo, hi, s);
}
const char* VariantName() { return "AArch64 with FMA"; }
#else
void Chunk(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  ChunkOf<false>(l, lo, hi, s);
}
const char* VariantName() { return "without FMA (an untested processor)"; }
#endif

struct Work {
  std::vector<Leaf> leaves;
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (leaf, first element)
  Scalars s;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    const int64_t total = static_cast<int64_t>(chunks.size());
    for (int64_t c; (c = next.fetch_add(1)) < total;) {
      const auto [leaf, lo] = chunks[c];
      const Leaf& l = leaves[leaf];
      Chunk(l, lo, std::min(lo + kChunk, l.n), s);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The calling thread works too: with the pool's threads less one, as many threads run
// as the pool has (more would only take turns on the same cores).
void Parallel(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  const int64_t total = static_cast<int64_t>(work->chunks.size());
  int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, total - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

bool Half(ffi::DataType t) { return t == ffi::DataType::BF16; }
bool Supported(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F32; }

ffi::Error Check(bool ok, const char* what) {
  return ok ? ffi::Error::Success()
            : ffi::Error::InvalidArgument(std::string("offload_eqx_adamw: ") + what);
}

ffi::Error LeafAt(ffi::RemainingArgs& args, ffi::RemainingRets& rets, size_t i, int8_t flags,
                  Leaf& leaf) {
  auto g = args.get<ffi::AnyBuffer>(4 * i);
  auto m = args.get<ffi::Buffer<ffi::F32>>(4 * i + 1);
  auto mu = args.get<ffi::Buffer<ffi::F32>>(4 * i + 2);
  auto nu = args.get<ffi::Buffer<ffi::F32>>(4 * i + 3);
  auto m_out = rets.get<ffi::Buffer<ffi::F32>>(4 * i);
  auto mu_out = rets.get<ffi::Buffer<ffi::F32>>(4 * i + 1);
  auto nu_out = rets.get<ffi::Buffer<ffi::F32>>(4 * i + 2);
  auto p_out = rets.get<ffi::AnyBuffer>(4 * i + 3);
  if (!g || !m || !mu || !nu || !m_out || !mu_out || !nu_out || !p_out) {
    return ffi::Error::InvalidArgument("offload_eqx_adamw: a leaf's buffers have other types");
  }
  const int64_t n = m->element_count();
  if (g->element_count() != n || mu->element_count() != n || nu->element_count() != n ||
      (*p_out)->element_count() != n) {
    return ffi::Error::InvalidArgument("offload_eqx_adamw: a leaf's operand sizes differ");
  }
  if (!Supported(g->element_type()) || !Supported((*p_out)->element_type())) {
    return ffi::Error::InvalidArgument(
        "offload_eqx_adamw: gradients and parameters must be bfloat16 or float32");
  }
  // The outputs alias the inputs; copy where XLA gave them buffers of their own.
  float* mo = (*m_out)->typed_data();
  float* muo = (*mu_out)->typed_data();
  float* nuo = (*nu_out)->typed_data();
  if (mo != m->typed_data()) std::memcpy(mo, m->typed_data(), n * 4);
  if (muo != mu->typed_data()) std::memcpy(muo, mu->typed_data(), n * 4);
  if (nuo != nu->typed_data()) std::memcpy(nuo, nu->typed_data(), n * 4);
  leaf = Leaf{g->untyped_data(), mo, muo, nuo, (*p_out)->untyped_data(), n,
              Half(g->element_type()), Half((*p_out)->element_type()), (flags & 1) != 0,
              (flags & 2) != 0, (flags & 4) != 0};
  return ffi::Error::Success();
}

ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                 ffi::RemainingRets rets, ffi::Span<const int8_t> flags) {
  const size_t count = flags.size();
  if (auto e = Check(scalars.element_count() == 12, "expected 12 scalars"); e.failure()) return e;
  if (auto e = Check(args.size() == 4 * count && rets.size() == 4 * count,
                     "expected 4 operands and 4 results per leaf");
      e.failure()) {
    return e;
  }
  auto work = std::make_shared<Work>();
  std::memcpy(&work->s, scalars.typed_data(), 12 * sizeof(float));
  work->s.r1 = 1.0f / work->s.c1;
  work->s.r2 = 1.0f / work->s.c2;
  for (size_t i = 0; i < count; ++i) {
    Leaf leaf;
    if (auto e = LeafAt(args, rets, i, flags[i], leaf); e.failure()) return e;
    work->leaves.push_back(leaf);
    for (int64_t lo = 0; lo < leaf.n; lo += kChunk) work->chunks.emplace_back(i, lo);
  }
  if (!work->chunks.empty()) Parallel(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OffloadEqxAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int8_t>>("flags"));

// Which arithmetic this process runs (`ox.host_kernels()` prints it).
extern "C" const char* OffloadEqxAdamWVariant() { return VariantName(); }
