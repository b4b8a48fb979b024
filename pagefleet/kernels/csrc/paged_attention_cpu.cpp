// Paged attention on CPU: every query row of a step (decodes and prefill/extend chunks) in
// one call, reading each sequence's K/V blocks in place through its block table.
//
// Plain C++ with a C ABI, no torch headers: it builds in about a second with g++ and is
// called through ctypes with raw pointers (see pagefleet/kernels/cpu_attention.py).
//
// Layout (pagefleet/kernels/metadata.py): q/out [T, Hq, D] fp32, contiguous; K/V cache
// [num_blocks, block_size, Hkv, D] (fp32, or bf16 as uint16); block_tables [S, W] int32;
// query_start_loc [S + 1] int32; seq_lens [S] int32. Row r of sequence s sits at position
// seq_lens[s] - qlen(s) + (r - query_start_loc[s]) and attends to positions 0..that.
//
// One work item is (sequence, KV head, a tile of up to kTile query rows): the tile's rows
// times the `group` query heads sharing the KV head are M query vectors that share every
// K/V row loaded. Softmax is online over blocks (running max, running sum, rescaled
// accumulator), all in fp32; the causal mask is a per-vector count of valid tokens in the
// block, so no -inf arithmetic is needed. Chunks of more than kChunkMinRows rows go through
// the process's MKL GEMM when the caller handed it in (pf_set_blas: attend_chunk_gemm),
// else through attend_chunk's vector loops.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_exp.h"

namespace {

constexpr int kTile = 8;       // most query rows of one sequence per work item (short chunks)
constexpr int kMaxBlock = 64;  // largest block_size the kernel handles
constexpr int kMaxVecs = 64;   // query vectors per work item: tile rows x group <= this
constexpr int kLanes = 16;     // query vectors scored together by the chunk path (one zmm)
constexpr int kKeys = 4;       // keys scored together by the chunk path (4 accumulators)
// Chunks with more new rows than this take the chunk path (attend_chunk): one KV head per
// work item, its query vectors transposed so every key is scored against 16 of them in one
// vector multiply-add, instead of one horizontal dot product per (vector, key).
constexpr int kChunkMinRows = 8;

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline float load(const T* p, int i);
template <>
inline float load<float>(const float* p, int i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int i) { return bf16_to_f32(p[i]); }

struct Item {
  int32_t seq, row0, rows, head0, heads;  // query rows [row0, row0+rows), KV heads [head0, +heads)
  int32_t chunk;  // 2: attend_chunk_gemm, 1: attend_chunk (both heads == 1), 0: attend_item
};

// Position of the item's first query row in its sequence (it attends to 0..that).
inline int32_t first_position(const Item& it, const int32_t* qsl, const int32_t* seq_lens) {
  return seq_lens[it.seq] - (qsl[it.seq + 1] - qsl[it.seq]) + (it.row0 - qsl[it.seq]);
}

// Row strides (in elements) of q and out: q is usually a view into the fused qk tensor.
struct Strides {
  int64_t q_row, out_row;
};

// Fortran SGEMM and MKL_Set_Num_Threads_Local of the MKL in the caller's process (torch's),
// handed in by pf_set_blas; null: long chunks take attend_chunk's hand-written loops.
// Column-major, every argument by pointer, as the Fortran ABI has it.
using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);
using SetThreadsLocalFn = int (*)(int);
SgemmFn g_sgemm = nullptr;
SetThreadsLocalFn g_set_threads_local = nullptr;

// Normalised output of query vector m (row it.row0 + m / per_row, query head
// it.head0 * group + m % per_row): acc[m] / sum[m].
template <int kD>
void write_out(const Item& it, int per_row, int group, int m_count, const float (*acc)[kD],
               const float* sum, float* out, Strides st, int d) {
  for (int m = 0; m < m_count; ++m) {
    const int row = it.row0 + m / per_row;
    const int qh = it.head0 * group + m % per_row;
    float* dst = out + row * st.out_row + static_cast<int64_t>(qh) * d;
    const float inv = 1.0f / sum[m];
    for (int i = 0; i < d; ++i) dst[i] = acc[m][i] * inv;
  }
}

template <typename T, int D>
void attend_item(const Item& it, const float* q, const T* kc, const T* vc,
                 const int32_t* tables, int table_w, const int32_t* qsl,
                 const int32_t* seq_lens, float* out, Strides st, int hq, int hkv, int bs,
                 int d_rt, float scale) {
  constexpr int kD = D > 0 ? D : 256;
  const int d = D > 0 ? D : d_rt;
  const int group = hq / hkv;
  const int per_row = it.heads * group;  // query vectors per row
  const int m_count = it.rows * per_row;
  const int32_t first_pos = first_position(it, qsl, seq_lens);
  const int32_t* table = tables + static_cast<int64_t>(it.seq) * table_w;
  const int64_t tok_stride = static_cast<int64_t>(hkv) * d;

  // Query vector m = row it.row0 + m / per_row, query head it.head0 * group + m % per_row,
  // reading KV head it.head0 + (m % per_row) / group (offset koff[m] within a token's row);
  // its context ends at position first_pos + m / per_row (inclusive), ctx[m] tokens.
  alignas(64) float qv[kMaxVecs][kD];
  alignas(64) float acc[kMaxVecs][kD];
  float mx[kMaxVecs], sum[kMaxVecs];
  int32_t ctx[kMaxVecs];
  int64_t koff[kMaxVecs];
  for (int m = 0; m < m_count; ++m) {
    const int row = it.row0 + m / per_row;
    const int qh = it.head0 * group + m % per_row;
    const float* src = q + row * st.q_row + static_cast<int64_t>(qh) * d;
    for (int i = 0; i < d; ++i) qv[m][i] = src[i] * scale;
    for (int i = 0; i < d; ++i) acc[m][i] = 0.0f;
    mx[m] = -INFINITY;
    sum[m] = 0.0f;
    ctx[m] = first_pos + m / per_row + 1;
    koff[m] = static_cast<int64_t>(qh / group) * d;
  }
  const int32_t ctx_max = first_pos + it.rows;  // the last row's context length
  const int n_blocks = (ctx_max + bs - 1) / bs;
  alignas(64) float s[kMaxVecs][kMaxBlock];
  for (int b = 0; b < n_blocks; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * bs * tok_stride;
    const T* kb = kc + base;
    const T* vb = vc + base;
    const int tok0 = b * bs;
    const int n_tok = ctx_max - tok0 < bs ? ctx_max - tok0 : bs;
    // Prefetch the next block while this one is scored: blocks are scattered in the pool,
    // so the hardware prefetcher loses the stream at every block edge (~15% measured).
    // Into L2 (prefetcht1), not L1: an L1 prefetch holds a fill buffer until the line
    // arrives, which caps the misses in flight; a 2x16-token block fits L2 with room to
    // spare. Decode batches of 16-40 rows x 250-620 tokens: 8-12% faster (session 8).
    const bool more = b + 1 < n_blocks;
    const int64_t next = more ? static_cast<int64_t>(table[b + 1]) * bs * tok_stride : 0;
    for (int t = 0; t < n_tok; ++t) {
      const T* kt = kb + t * tok_stride;
      if (more) {
        const char* pk = reinterpret_cast<const char*>(kc + next + t * tok_stride);
        const char* pv = reinterpret_cast<const char*>(vc + next + t * tok_stride);
        for (int64_t off = 0; off < tok_stride * static_cast<int64_t>(sizeof(T)); off += 64) {
          __builtin_prefetch(pk + off, 0, 2);
          __builtin_prefetch(pv + off, 0, 2);
        }
      }
      for (int m = 0; m < m_count; ++m) {
        const T* km = kt + koff[m];
        const float* qm = qv[m];
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < d; ++i) dot += qm[i] * load(km, i);
        s[m][t] = dot;
      }
    }
    for (int m = 0; m < m_count; ++m) {
      int valid = ctx[m] - tok0;
      if (valid <= 0) continue;
      if (valid > n_tok) valid = n_tok;
      float bmax = s[m][0];
      for (int t = 1; t < valid; ++t) bmax = s[m][t] > bmax ? s[m][t] : bmax;
      const float new_max = bmax > mx[m] ? bmax : mx[m];
      const float alpha = pf::exp_clamped(mx[m] - new_max);  // mx = -inf at first: exp -> 0
      mx[m] = new_max;
      float bsum = 0.0f;
#pragma omp simd reduction(+ : bsum)
      for (int t = 0; t < valid; ++t) {
        const float p = pf::exp_clamped(s[m][t] - new_max);
        s[m][t] = p;
        bsum += p;
      }
      for (int t = valid; t < n_tok; ++t) s[m][t] = 0.0f;  // masked: weight 0
      sum[m] = sum[m] * alpha + bsum;
      if (alpha != 1.0f) {
        for (int i = 0; i < d; ++i) acc[m][i] *= alpha;
      }
    }
    for (int m = 0; m < m_count; ++m) {
      int valid = ctx[m] - tok0;
      if (valid <= 0) continue;
      if (valid > n_tok) valid = n_tok;
      // V rows of this vector's head, accumulated in a local copy the compiler keeps in
      // registers across the block's tokens.
      const T* vm = vb + koff[m];
      alignas(64) float a[kD];
      for (int i = 0; i < d; ++i) a[i] = acc[m][i];
      for (int t = 0; t < valid; ++t) {
        const float p = s[m][t];
        const T* vt = vm + t * tok_stride;
#pragma omp simd
        for (int i = 0; i < d; ++i) a[i] += p * load(vt, i);
      }
      for (int i = 0; i < d; ++i) acc[m][i] = a[i];
    }
  }
  write_out<kD>(it, per_row, group, m_count, acc, sum, out, st, d);
}

// One KV head, up to kMaxVecs query vectors of a long chunk (rows x the head's group):
// the flash-attention loop with the query vectors as the vector lanes. Scores of kKeys
// keys x kLanes vectors sit in registers while head_dim is walked once; softmax runs down
// the lanes; P x V keeps two vectors' accumulators in registers per pass over the block.
template <typename T, int D>
void attend_chunk(const Item& it, const float* q, const T* kc, const T* vc,
                  const int32_t* tables, int table_w, const int32_t* qsl,
                  const int32_t* seq_lens, float* out, Strides st, int hq, int hkv, int bs,
                  int d_rt, float scale) {
  constexpr int kD = D > 0 ? D : 256;
  const int d = D > 0 ? D : d_rt;
  const int group = hq / hkv;
  const int m_count = it.rows * group;
  const int m_pad = (m_count + kLanes - 1) / kLanes * kLanes;
  const int32_t first_pos = first_position(it, qsl, seq_lens);
  const int32_t* table = tables + static_cast<int64_t>(it.seq) * table_w;
  const int64_t tok_stride = static_cast<int64_t>(hkv) * d;
  const int64_t koff = static_cast<int64_t>(it.head0) * d;

  // Vector m: row it.row0 + m / group, query head it.head0 * group + m % group.
  alignas(64) float qt[kD][kMaxVecs];    // scaled queries, transposed: qt[i][m]
  alignas(64) float acc[kMaxVecs][kD];
  alignas(64) float sc[kMaxBlock][kMaxVecs];  // this block's scores, then weights: sc[t][m]
  alignas(64) float mx[kMaxVecs], sum[kMaxVecs], alpha[kMaxVecs];
  alignas(64) int32_t ctx[kMaxVecs];
  for (int m = 0; m < m_pad; ++m) {
    const bool real = m < m_count;
    const int row = it.row0 + (real ? m / group : 0);
    const int qh = it.head0 * group + (real ? m % group : 0);
    const float* src = q + row * st.q_row + static_cast<int64_t>(qh) * d;
    for (int i = 0; i < d; ++i) qt[i][m] = real ? src[i] * scale : 0.0f;
    for (int i = 0; i < d; ++i) acc[m][i] = 0.0f;
    mx[m] = -INFINITY;
    sum[m] = 0.0f;
    ctx[m] = real ? first_pos + m / group + 1 : 0;  // padding lanes see no key
  }
  const int32_t ctx_max = first_pos + it.rows;
  const int n_blocks = (ctx_max + bs - 1) / bs;
  for (int b = 0; b < n_blocks; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * bs * tok_stride + koff;
    const T* kb = kc + base;
    const T* vb = vc + base;
    const int tok0 = b * bs;
    const int n_tok = ctx_max - tok0 < bs ? ctx_max - tok0 : bs;
    // Scores: kKeys keys x kLanes vectors per pass over head_dim.
    for (int c = 0; c < m_pad; c += kLanes) {
      for (int t0 = 0; t0 < n_tok; t0 += kKeys) {
        const T* kr[kKeys];
        for (int j = 0; j < kKeys; ++j) {
          const int t = t0 + j < n_tok ? t0 + j : t0;  // past the block: a harmless repeat
          kr[j] = kb + t * tok_stride;
        }
        alignas(64) float a[kKeys][kLanes] = {};
        for (int i = 0; i < d; ++i) {
          const float* qi = &qt[i][c];
          const float x0 = load(kr[0], i), x1 = load(kr[1], i);
          const float x2 = load(kr[2], i), x3 = load(kr[3], i);
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) {
            a[0][l] += x0 * qi[l];
            a[1][l] += x1 * qi[l];
            a[2][l] += x2 * qi[l];
            a[3][l] += x3 * qi[l];
          }
        }
        for (int j = 0; j < kKeys && t0 + j < n_tok; ++j) {
          for (int l = 0; l < kLanes; ++l) sc[t0 + j][c + l] = a[j][l];
        }
      }
    }
    // Online softmax down the lanes; a key past a vector's position weighs exactly 0.
    // The block's max and sum walk the keys in order with the vectors as lanes (rows of
    // sc are contiguous): the same max and the same per-vector order of additions as a
    // scalar loop per vector, so results are bit-identical, without 2 x 16 x 64 scalar steps.
    alignas(64) float bmax[kMaxVecs], bsum[kMaxVecs];
    for (int m = 0; m < m_pad; ++m) bmax[m] = -INFINITY;
    for (int t = 0; t < n_tok; ++t) {
      const float* row = sc[t];
#pragma omp simd
      for (int m = 0; m < m_pad; ++m) {
        const float x = (t < ctx[m] - tok0) ? row[m] : -INFINITY;
        bmax[m] = x > bmax[m] ? x : bmax[m];
      }
    }
    bool rescale = false;
    for (int m = 0; m < m_pad; ++m) {
      const int valid = ctx[m] - tok0;
      const float new_max = bmax[m] > mx[m] ? bmax[m] : mx[m];
      alpha[m] = valid > 0 ? pf::exp_clamped(mx[m] - new_max) : 1.0f;
      rescale |= alpha[m] != 1.0f;
      mx[m] = new_max;
    }
    for (int t = 0; t < n_tok; ++t) {
      float* row = sc[t];
#pragma omp simd
      for (int m = 0; m < m_pad; ++m) {
        const float p = pf::exp_clamped(row[m] - mx[m]);
        row[m] = (t < ctx[m] - tok0) ? p : 0.0f;
      }
    }
    for (int m = 0; m < m_pad; ++m) bsum[m] = 0.0f;
    for (int t = 0; t < n_tok; ++t) {
      const float* row = sc[t];
#pragma omp simd
      for (int m = 0; m < m_pad; ++m) bsum[m] += row[m];
    }
    for (int m = 0; m < m_pad; ++m) sum[m] = sum[m] * alpha[m] + bsum[m];
    if (rescale) {
      for (int m = 0; m < m_count; ++m) {
        if (alpha[m] == 1.0f) continue;
        const float f = alpha[m];
#pragma omp simd
        for (int i = 0; i < d; ++i) acc[m][i] *= f;
      }
    }
    // P x V, two vectors per pass over the block's V rows.
    for (int m = 0; m < m_count; m += 2) {
      const int m1 = m + 1 < m_count ? m + 1 : m;
      alignas(64) float a0[kD], a1[kD];
      for (int i = 0; i < d; ++i) {
        a0[i] = acc[m][i];
        a1[i] = acc[m1][i];
      }
      for (int t = 0; t < n_tok; ++t) {
        const float p0 = sc[t][m], p1 = sc[t][m1];
        const T* vt = vb + t * tok_stride;
#pragma omp simd
        for (int i = 0; i < d; ++i) {
          const float x = load(vt, i);
          a0[i] += p0 * x;
          a1[i] += p1 * x;
        }
      }
      for (int i = 0; i < d; ++i) acc[m][i] = a0[i];
      if (m1 != m) {
        for (int i = 0; i < d; ++i) acc[m1][i] = a1[i];
      }
    }
  }
  write_out<kD>(it, group, group, m_count, acc, sum, out, st, d);
}

// A whole prefill/extend chunk of one sequence and one KV head through BLAS: its context's
// K and V rows (this head's) gathered once into contiguous fp32 buffers, then per tile of
// rows S = Q K^T and O = P V as GEMMs, with an exact (not online) softmax between
// them. A chunk's attention is compute-bound (every key meets every query row), and MKL's
// GEMM runs it faster than attend_chunk's vector loops (0.67-0.99x their time, session 11).
// A tile is kGemmVecs query vectors (rows x the KV head's group): the score tile, and so
// the per-thread scratch, stays 64 x context floats whatever the GQA group.
constexpr int kGemmVecs = 64;

// Query rows per GEMM tile. The chunk split in pf_paged_attention cuts at multiples of it,
// so a split item runs exactly the unsplit item's tiles.
inline int32_t gemm_tile_rows(int group) { return group < kGemmVecs ? kGemmVecs / group : 1; }
// Scratch a thread keeps between calls, per buffer (1M floats, 4 MB: a context of 8K tokens
// at head_dim 128). A longer context's buffers are given back after the call: kept, 32K
// tokens would hold ~40 MB on every OpenMP thread for the life of the process, which a pod
// sized for weights and KV pool does not have. Regrowing them costs a page-in per call, small
// beside a GEMM over that many keys.
constexpr size_t kScratchKeepFloats = size_t{1} << 20;
// Bytes of GEMM scratch currently held by all threads (pf_scratch_bytes; tests read it).
std::atomic<int64_t> g_scratch_bytes{0};

// Grow v to at least n floats, counting what its capacity adds.
void grow(std::vector<float>& v, size_t n) {
  if (v.size() >= n) return;
  const size_t before = v.capacity();
  v.resize(n);
  g_scratch_bytes += static_cast<int64_t>((v.capacity() - before) * sizeof(float));
}

// Give v's memory back when it holds more than a thread keeps between calls.
void trim(std::vector<float>& v) {
  if (v.capacity() <= kScratchKeepFloats) return;
  g_scratch_bytes -= static_cast<int64_t>(v.capacity() * sizeof(float));
  std::vector<float>().swap(v);
}

template <typename T>
void gather_head(const T* cache, const int32_t* table, int bs, int64_t tok_stride,
                 int64_t koff, int n, int d, float* dst) {
  for (int p = 0; p < n; ++p) {
    const T* src = cache + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * tok_stride + koff;
    float* row = dst + static_cast<int64_t>(p) * d;
    for (int i = 0; i < d; ++i) row[i] = load(src, i);
  }
}

template <typename T>
void attend_chunk_gemm(const Item& it, const float* q, const T* kc, const T* vc,
                       const int32_t* tables, int table_w, const int32_t* qsl,
                       const int32_t* seq_lens, float* out, Strides st, int hq, int hkv,
                       int bs, int d, float scale) {
  const int group = hq / hkv;
  const int32_t first_pos = first_position(it, qsl, seq_lens);
  const int32_t ctx_max = first_pos + it.rows;
  const int32_t* table = tables + static_cast<int64_t>(it.seq) * table_w;
  const int64_t tok_stride = static_cast<int64_t>(hkv) * d;
  const int64_t koff = static_cast<int64_t>(it.head0) * d;
  const int tile_rows = gemm_tile_rows(group);
  const int m_tile = tile_rows * group;
  // Per-thread scratch, grown as needed and kept up to kScratchKeepFloats a buffer: no
  // allocation per call once warm, for contexts up to that size.
  thread_local std::vector<float> kbuf, vbuf, qbuf, sbuf, obuf;
  const size_t ctx_elems = static_cast<size_t>(ctx_max) * d;
  grow(kbuf, ctx_elems);
  grow(vbuf, ctx_elems);
  grow(qbuf, static_cast<size_t>(m_tile) * d);
  grow(obuf, static_cast<size_t>(m_tile) * d);
  grow(sbuf, static_cast<size_t>(m_tile) * ctx_max);
  gather_head(kc, table, bs, tok_stride, koff, ctx_max, d, kbuf.data());
  gather_head(vc, table, bs, tok_stride, koff, ctx_max, d, vbuf.data());
  // One thread per call: the caller's OpenMP team already spreads the items over the
  // cores, and a fixed thread count keeps results independent of it.
  const int prev_threads = g_set_threads_local ? g_set_threads_local(1) : 0;
  const float one = 1.0f, zero = 0.0f;
  for (int r0 = 0; r0 < it.rows; r0 += tile_rows) {
    const int rows = it.rows - r0 < tile_rows ? it.rows - r0 : tile_rows;
    const int m_count = rows * group;
    const int n = first_pos + r0 + rows;  // keys this tile's last row sees
    // Vector m: row it.row0 + r0 + m / group, query head it.head0 * group + m % group.
    for (int m = 0; m < m_count; ++m) {
      const int row = it.row0 + r0 + m / group;
      const int qh = it.head0 * group + m % group;
      const float* src = q + row * st.q_row + static_cast<int64_t>(qh) * d;
      float* dst = qbuf.data() + static_cast<int64_t>(m) * d;
      for (int i = 0; i < d; ++i) dst[i] = src[i] * scale;
    }
    // Row-major S[m_count x n] = Q K^T is column-major S^T = K Q^T.
    g_sgemm("T", "N", &n, &m_count, &d, &one, kbuf.data(), &d, qbuf.data(), &d, &zero,
            sbuf.data(), &n);
    for (int m = 0; m < m_count; ++m) {
      float* srow = sbuf.data() + static_cast<int64_t>(m) * n;
      const int valid = first_pos + r0 + m / group + 1;  // causal: keys 0..own position
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int t = 0; t < valid; ++t) mx = srow[t] > mx ? srow[t] : mx;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < valid; ++t) {
        const float p = pf::exp_clamped(srow[t] - mx);
        srow[t] = p;
        sum += p;
      }
      const float inv = 1.0f / sum;
      // Normalised before P V (as SDPA's softmax is), masked keys weigh exactly 0.
#pragma omp simd
      for (int t = 0; t < valid; ++t) srow[t] *= inv;
      for (int t = valid; t < n; ++t) srow[t] = 0.0f;
    }
    // Row-major O[m_count x d] = P V is column-major O^T = V^T P^T.
    g_sgemm("N", "N", &d, &m_count, &n, &one, vbuf.data(), &d, sbuf.data(), &n, &zero,
            obuf.data(), &d);
    for (int m = 0; m < m_count; ++m) {
      const int row = it.row0 + r0 + m / group;
      const int qh = it.head0 * group + m % group;
      std::memcpy(out + row * st.out_row + static_cast<int64_t>(qh) * d,
                  obuf.data() + static_cast<int64_t>(m) * d, sizeof(float) * d);
    }
  }
  if (g_set_threads_local) g_set_threads_local(prev_threads);
  trim(kbuf);
  trim(vbuf);
  trim(sbuf);
}

template <typename T, int D>
void run(const std::vector<Item>& items, const float* q, const T* kc, const T* vc,
         const int32_t* tables, int table_w, const int32_t* qsl, const int32_t* seq_lens,
         float* out, Strides st, int hq, int hkv, int bs, int d, float scale, int threads) {
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) {
    if (items[i].chunk == 2) {
      attend_chunk_gemm<T>(items[i], q, kc, vc, tables, table_w, qsl, seq_lens, out, st, hq,
                           hkv, bs, d, scale);
    } else if (items[i].chunk) {
      attend_chunk<T, D>(items[i], q, kc, vc, tables, table_w, qsl, seq_lens, out, st, hq,
                         hkv, bs, d, scale);
    } else {
      attend_item<T, D>(items[i], q, kc, vc, tables, table_w, qsl, seq_lens, out, st, hq,
                        hkv, bs, d, scale);
    }
  }
}

template <typename T>
int dispatch(const std::vector<Item>& items, const float* q, const T* kc, const T* vc,
             const int32_t* tables, int table_w, const int32_t* qsl, const int32_t* seq_lens,
             float* out, Strides st, int hq, int hkv, int bs, int d, float scale,
             int threads) {
#define PF_CASE(DIM)                                                                      \
  case DIM:                                                                               \
    run<T, DIM>(items, q, kc, vc, tables, table_w, qsl, seq_lens, out, st, hq, hkv, bs, d,\
                scale, threads);                                                          \
    return 0;
  switch (d) {
    PF_CASE(16)
    PF_CASE(32)
    PF_CASE(64)
    PF_CASE(80)
    PF_CASE(96)
    PF_CASE(128)
    default:
      if (d > 256) return 3;
      run<T, 0>(items, q, kc, vc, tables, table_w, qsl, seq_lens, out, st, hq, hkv, bs, d,
                scale, threads);
      return 0;
  }
#undef PF_CASE
}

// RoPE, rotate-half (NeoX) layout, in place: row r, head h of x becomes
// x * cos[r] + rotate_half(x) * sin[r]. Products and sum are rounded separately (no fused
// multiply-add), as torch's elementwise ops do, so results are bit-identical to them.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rope_neox(float* x, int64_t row_stride, int64_t rows, int heads, int d, const float* cos,
               const float* sin) {
  const int half = d / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int h = 0; h < heads; ++h) {
      float* p = x + r * row_stride + static_cast<int64_t>(h) * d;
      for (int i = 0; i < half; ++i) {
        const float a = p[i], b = p[i + half];
        const float lo_c = a * c[i], lo_s = -b * s[i];
        const float hi_c = b * c[i + half], hi_s = a * s[i + half];
        p[i] = lo_c + lo_s;
        p[i + half] = hi_c + hi_s;
      }
    }
  }
}
#pragma GCC pop_options

}  // namespace

extern "C" {

// In-place RoPE of x [rows, heads, d] (heads x d contiguous within a row, rows row_stride
// apart) with per-row tables cos/sin [rows, d], all fp32. d must be even.
void pf_rope_neox(float* x, int64_t row_stride, int64_t rows, int heads, int d,
                  const float* cos, const float* sin) {
  rope_neox(x, row_stride, rows, heads, d, cos, sin);
}

// Copy row t of k and v (row_elems elements each, rows k_row_stride / v_row_stride apart)
// into flat slot slots[t] of the caches (slot_stride = row_elems); slot -1 is skipped.
// elem_bytes: 4 (fp32) or 2 (bf16/fp16), the same for the rows and the caches.
void pf_store_kv(const char* k, int64_t k_row_stride, const char* v, int64_t v_row_stride,
                 const int64_t* slots, int64_t rows, int64_t row_elems, int elem_bytes,
                 char* k_cache, char* v_cache) {
  const int64_t row_bytes = row_elems * elem_bytes;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * row_bytes, k + t * k_row_stride * elem_bytes, row_bytes);
    std::memcpy(v_cache + slot * row_bytes, v + t * v_row_stride * elem_bytes, row_bytes);
  }
}

// RoPE of the q and k heads of packed fp32 qkv rows [rows][(hq + 2 * hkv) * d] (rows
// row_stride elements apart) in place, then the row's rotated K and its V into flat slot
// slots[t] of the fp32 caches (slot -1 is skipped). One call where there were two: in a
// decode step each call's Python side runs with caches the GEMMs just flushed, 30-50 us a
// call (a whole RMSNorm call takes ~13 us standalone); one pass reads each row once.
void pf_rope_store(float* qkv, int64_t row_stride, int64_t rows, int hq, int hkv, int d,
                   const float* cos, const float* sin, const int64_t* slots, float* k_cache,
                   float* v_cache) {
  const int64_t kv_elems = static_cast<int64_t>(hkv) * d;
  for (int64_t t = 0; t < rows; ++t) {
    float* row = qkv + t * row_stride;
    rope_neox(row, row_stride, 1, hq + hkv, d, cos + t * d, sin + t * d);
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    std::memcpy(k_cache + slot * kv_elems, row + static_cast<int64_t>(hq) * d,
                kv_elems * sizeof(float));
    std::memcpy(v_cache + slot * kv_elems, row + static_cast<int64_t>(hq) * d + kv_elems,
                kv_elems * sizeof(float));
  }
}

// Fortran SGEMM and MKL_Set_Num_Threads_Local (may be null) of the process's MKL: long
// chunks then go through attend_chunk_gemm. Null sgemm: back to attend_chunk.
void pf_set_blas(void* sgemm, void* set_threads_local) {
  g_sgemm = reinterpret_cast<SgemmFn>(sgemm);
  g_set_threads_local = reinterpret_cast<SetThreadsLocalFn>(set_threads_local);
}

// Bytes of chunk-GEMM scratch all threads hold between calls (at most a few times
// kScratchKeepFloats floats per thread, whatever the longest context seen).
int64_t pf_scratch_bytes() { return g_scratch_bytes.load(); }

// The limits a caller must respect (else pf_paged_attention returns non-zero).
int pf_max_block_size() { return kMaxBlock; }
int pf_max_group() { return kMaxVecs; }
int pf_max_head_dim() { return 256; }

// Attention of all T packed query rows (see the file comment). kv_dtype: 0 fp32, 1 bf16.
// q_row_stride / out_row_stride: elements between consecutive rows (heads x D contiguous
// within a row). Sequences with more than max_query_len new rows are skipped (their out rows
// are left as they are: the caller attends them another way). Returns 0 on success, 1-3 for a shape the kernel does not cover (nothing
// written then).
int pf_paged_attention(const float* q, int64_t q_row_stride, const void* k_cache,
                       const void* v_cache, int kv_dtype, const int32_t* block_tables,
                       int table_w, const int32_t* query_start_loc, const int32_t* seq_lens,
                       int num_seqs, float* out, int64_t out_row_stride, int hq, int hkv,
                       int block_size, int head_dim, float scale, int max_query_len,
                       int threads) {
  if (block_size < 1 || block_size > kMaxBlock) return 1;
  if (hkv < 1 || hq % hkv != 0 || hq / hkv > kMaxVecs) return 2;
  const Strides st{q_row_stride, out_row_stride};
  // A work item takes as many KV heads as fit kMaxVecs query vectors (all of them for
  // a decode row of most models: each token's K/V row is then streamed once), and as
  // many of a prefill chunk's rows as fit beside them; with several threads and few
  // sequences, heads are split further so every thread gets work.
  const int group = hq / hkv;
  int heads = hkv < kMaxVecs / group ? hkv : kMaxVecs / group;
  if (threads > 1) {
    while (heads > 1 && static_cast<int64_t>(num_seqs) * ((hkv + heads - 1) / heads) < 4 * threads)
      heads = (heads + 1) / 2;
  }
  int32_t tile = kMaxVecs / (heads * group);
  tile = tile < kTile ? tile : kTile;
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(num_seqs) * ((hkv + heads - 1) / heads));
  // Long chunks: one KV head and as many rows as fit kMaxVecs vectors per item.
  const int32_t chunk_rows = kMaxVecs / group;
  std::vector<Item> gemm_items;
  for (int s = 0; s < num_seqs; ++s) {
    const int32_t qlen = query_start_loc[s + 1] - query_start_loc[s];
    if (qlen > max_query_len) continue;
    if (qlen > kChunkMinRows && g_sgemm != nullptr) {
      // The whole chunk per KV head (its context gathered once); the biggest go first
      // (below) so the dynamic schedule does not end on one thread's long item.
      for (int h = 0; h < hkv; ++h) gemm_items.push_back({s, query_start_loc[s], qlen, h, 1, 2});
      continue;
    }
    if (qlen > kChunkMinRows) {
      for (int32_t r = query_start_loc[s]; r < query_start_loc[s + 1]; r += chunk_rows) {
        const int32_t left = query_start_loc[s + 1] - r;
        for (int h = 0; h < hkv; ++h) {
          items.push_back({s, r, left < chunk_rows ? left : chunk_rows, h, 1, 1});
        }
      }
      continue;
    }
    for (int32_t r = query_start_loc[s]; r < query_start_loc[s + 1]; r += tile) {
      const int32_t left = query_start_loc[s + 1] - r;
      for (int h = 0; h < hkv; h += heads) {
        items.push_back(
            {s, r, left < tile ? left : tile, h, hkv - h < heads ? hkv - h : heads, 0});
      }
    }
  }
  if (threads > 1 && !gemm_items.empty() &&
      static_cast<int64_t>(gemm_items.size()) < 4 * static_cast<int64_t>(threads)) {
    // Few whole-chunk items (one long prompt, few KV heads: 3 for SmolLM2 on 2 threads, 8
    // for Llama-3-8B on a 32-core pod) leave threads idle: split each at tile boundaries
    // into about 4 items per thread. The tiles, so every GEMM's shape and every row's
    // result, are those of the unsplit item; each piece gathers only the context it sees.
    const int32_t tile_rows = gemm_tile_rows(group);
    const int64_t per = (4 * static_cast<int64_t>(threads) + gemm_items.size() - 1) /
                        static_cast<int64_t>(gemm_items.size());
    std::vector<Item> split;
    for (const Item& it : gemm_items) {
      const int32_t tiles = (it.rows + tile_rows - 1) / tile_rows;
      const int32_t pieces = static_cast<int32_t>(per < tiles ? per : tiles);
      const int32_t step = (tiles + pieces - 1) / pieces * tile_rows;
      for (int32_t r = 0; r < it.rows; r += step) {
        const int32_t rows = it.rows - r < step ? it.rows - r : step;
        split.push_back({it.seq, it.row0 + r, rows, it.head0, 1, 2});
      }
    }
    gemm_items.swap(split);
  }
  if (!gemm_items.empty()) {
    // Work of an item ~ rows x the context its last row sees; stable so equal items keep
    // their order.
    const auto work = [&](const Item& it) {
      const int64_t ctx = first_position(it, query_start_loc, seq_lens) + it.rows;
      return static_cast<int64_t>(it.rows) * ctx;
    };
    std::stable_sort(gemm_items.begin(), gemm_items.end(),
                     [&](const Item& a, const Item& b) { return work(a) > work(b); });
    items.insert(items.begin(), gemm_items.begin(), gemm_items.end());
  }
  if (kv_dtype == 0) {
    return dispatch<float>(items, q, static_cast<const float*>(k_cache),
                           static_cast<const float*>(v_cache), block_tables, table_w,
                           query_start_loc, seq_lens, out, st, hq, hkv, block_size, head_dim,
                           scale, threads);
  }
  if (kv_dtype == 1) {
    return dispatch<uint16_t>(items, q, static_cast<const uint16_t*>(k_cache),
                              static_cast<const uint16_t*>(v_cache), block_tables, table_w,
                              query_start_loc, seq_lens, out, st, hq, hkv, block_size,
                              head_dim, scale, threads);
  }
  return 1;
}

}  // extern "C"
