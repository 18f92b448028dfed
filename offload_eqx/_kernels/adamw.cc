// AdamW on float32 masters in one in-place pass: offload_eqx's host update kernel.
//
// Registered with XLA as the FFI target "offload_eqx_adamw" on the CPU platform and
// called once per update from `offload_eqx/_optimizer/fused_adamw.py` with every leaf:
// operands `scalars`, then (g, m, mu, nu) per leaf; results (m', mu', nu', p') per leaf;
// attribute `decay`, one int8 per leaf (1 where weight decay applies). The caller
// computes every scalar (the bias corrections, the learning rate of this step) with the
// same XLA operations optax uses. Per element, in this order (optax 0.2's adamw on a
// master m, with gradient g cast to float32):
//
//   a  = k1 g + b1 mu            (k1 = 1 - b1, rounded to float32 as optax's is)
//   b  = k2 (g g) + b2 nu
//   u  = (a / c1) / (sqrt(b / c2 + eps_root) + eps)
//   u  = u + wd m                 (only where weight decay applies)
//   m' = m + step u               (step = -learning rate)
//   p' = m' rounded to the parameter's dtype (nearest even; NaN stays NaN)
//
// Each is one float32 operation rounded on its own: the file is compiled with
// -ffp-contract=off, so no multiply-add is fused. XLA:CPU fuses some (which ones depends
// on the rest of its loop), so a moment or a master may differ from XLA's in its last
// bit, as XLA's own results differ between two programs computing the same update.
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

inline float FromBf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  uint32_t quiet = (u >> 16) | 0x40u;  // a NaN stays a NaN of the same sign
  return static_cast<uint16_t>(f != f ? quiet : rounded);
}

struct Scalars {
  float k1, b1, k2, b2, c1, c2, eps_root, eps, wd, step;
};

template <typename G, typename P, bool kDecay>
void Update(int64_t lo, int64_t hi, const G* __restrict__ g, float* __restrict__ m,
            float* __restrict__ mu, float* __restrict__ nu, P* __restrict__ p,
            const Scalars s) {
  for (int64_t i = lo; i < hi; ++i) {
    float gi;
    if constexpr (sizeof(G) == 2) gi = FromBf16(g[i]); else gi = g[i];
    float a = s.k1 * gi + s.b1 * mu[i];
    float b = s.k2 * (gi * gi) + s.b2 * nu[i];
    mu[i] = a;
    nu[i] = b;
    float master = m[i];
    float u = (a / s.c1) / (std::sqrt(b / s.c2 + s.eps_root) + s.eps);
    if constexpr (kDecay) u = u + s.wd * master;
    master = master + s.step * u;
    m[i] = master;
    if constexpr (sizeof(P) == 2) p[i] = ToBf16(master); else p[i] = master;
  }
}

struct Leaf {
  const void* g;
  float *m, *mu, *nu;
  void* p;
  int64_t n;
  bool g_half, p_half, decay;
};

template <typename G, typename P>
void Typed(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  auto g = static_cast<const G*>(l.g);
  auto p = static_cast<P*>(l.p);
  if (l.decay) Update<G, P, true>(lo, hi, g, l.m, l.mu, l.nu, p, s);
  else Update<G, P, false>(lo, hi, g, l.m, l.mu, l.nu, p, s);
}

void Chunk(const Leaf& l, int64_t lo, int64_t hi, const Scalars& s) {
  if (l.g_half && l.p_half) Typed<uint16_t, uint16_t>(l, lo, hi, s);
  else if (l.g_half) Typed<uint16_t, float>(l, lo, hi, s);
  else if (l.p_half) Typed<float, uint16_t>(l, lo, hi, s);
  else Typed<float, float>(l, lo, hi, s);
}

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

ffi::Error LeafAt(ffi::RemainingArgs& args, ffi::RemainingRets& rets, size_t i, bool decay,
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
              Half(g->element_type()), Half((*p_out)->element_type()), decay};
  return ffi::Error::Success();
}

ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                 ffi::RemainingRets rets, ffi::Span<const int8_t> decay) {
  const size_t count = decay.size();
  if (auto e = Check(scalars.element_count() == 10, "expected 10 scalars"); e.failure()) return e;
  if (auto e = Check(args.size() == 4 * count && rets.size() == 4 * count,
                     "expected 4 operands and 4 results per leaf");
      e.failure()) {
    return e;
  }
  auto work = std::make_shared<Work>();
  std::memcpy(&work->s, scalars.typed_data(), sizeof(Scalars));
  for (size_t i = 0; i < count; ++i) {
    Leaf leaf;
    if (auto e = LeafAt(args, rets, i, decay[i] != 0, leaf); e.failure()) return e;
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
                                  .Attr<ffi::Span<const int8_t>>("decay"));
