// mok — grouped BF16 GEMMs over the experts of one rank (SM90 engine, host API).
//
// Row layout (the schedule's): the routed buffer holds num_m_tiles * 128 rows, each expert's rows
// contiguous and padded to a multiple of 128; tile_expert[m] (device memory) is the expert of
// M tile m (-1: skip). Weights of all experts are one [E, ., .] tensor (one 3-D tensor map).
// Element type is bf16 everywhere (pointers to 16-bit storage); accumulation is fp32, every
// output is rounded once to bf16 (the rounding points of mok/reference.hpp).
//
// Use: build a Plan once per shape and set of buffers (it encodes the TMA tensor maps), then
// run() it as often as needed; run() only launches. Results are bitwise reproducible: every
// output element is one fixed-order fp32 sum, no atomics, no split-K.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm_sizes.hpp"  // wgrad_carry_floats, router_parts

namespace mok::gemm {

struct Options {
  int max_ctas = 0;                // persistent CTAs; 0 = one per SM
  int group_m = 8;                 // tile raster: M tiles per group
  // M-grouped forms (FC1, FC2, the dgrads, their FP8 forms; not with clusters, and not in the
  // megakernels, which order their own tickets): raster groups split where the expert changes, so
  // no expert's weight tiles are read by two groups (schedule_math.h's expert_tile_raster). The
  // same tiles and bits in another order.
  bool group_experts = false;
  // Device word: nonzero after a bounded wait expired (the wait's site), or kSiteFp8Segment (the
  // FP8 wgrad's input was not 128-row aligned), or kSiteHeldRows (a wgrad's held rows past its
  // hold); the call's outputs are then undefined.
  unsigned int* error = nullptr;
  double wait_limit_s = 2.0;       // bound of every in-kernel wait when `error` is set
  // Stagger of the two consumer warpgroups in K blocks (0..4), or -1 = the form's default: 0 for
  // the BF16 forms, 1 for the FP8 ones (their epilogue is the longer; a stagger of 1 measured at or
  // above 0 in every FP8 case, bench/results/gemm-fp8-skew-h200x1.json). The 128-wide FP8 wgrad
  // has none (each warpgroup keeps two block accumulators instead).
  int skew_stages = -1;
  int block_n = 0;                 // output tile width: 256, 128, or 0 = choose by tile count
  bool cluster = false;            // 2-CTA clusters sharing (multicasting) the B operand
  // FC1/FC2 with expert rows given: tiles whose tokens fit in their first 64 rows run in split-N
  // form (both consumer warpgroups on those rows, half of the columns each; BLOCK_N 256 only).
  bool split_n = true;
  // Programmatic dependent launch: the kernel's start (barriers, tensor-map prefetch) overlaps the
  // end of the previous kernel in the stream; it reads and writes global memory only after that
  // kernel has completed (griddepcontrol.wait), so results are the same either way. Off until
  // measured and run through the whole GPU suite (the layer's unfused path uses these plans).
  bool pdl = false;
};

// Gate/up order ("packed order") of the FC1 pre-activations gu and of d_gu: in each group of 64
// columns, 32 gate columns then the 32 up columns of the same intermediate indices. FC1 reads
// w_gate and w_up where they are (two tensor maps of 32-row boxes fill the B tile in this order),
// so there is no packed copy of the weights; the order only shows in gu / d_gu (and in a
// packed-row wgrad without dw_up). inter must be a multiple of 32.
constexpr int64_t kGateUpGroup = 32;
// Options::skew_stages = -1 on the FP8 forms (above).
constexpr int kFp8DefaultSkew = 1;
constexpr int64_t packed_gate_row(int64_t i) { return (i / kGateUpGroup) * 2 * kGateUpGroup + i % kGateUpGroup; }
constexpr int64_t packed_up_row(int64_t i) { return packed_gate_row(i) + kGateUpGroup; }

// FC1 forward: gu[r] = the gate and up pre-activations x[r] . W_gate[e]^T, x[r] . W_up[e]^T
// (2*inter values in packed order), h[r] = rnd(silu(rnd(g)) * rnd(u)) (inter values).
struct Fc1Args {
  const void* x = nullptr;       // [num_m_tiles*128, hidden]
  const void* w_gate = nullptr;  // [experts, inter, hidden]
  const void* w_up = nullptr;    // [experts, inter, hidden]
  void* h = nullptr;             // [num_m_tiles*128, inter]
  void* gu = nullptr;            // [num_m_tiles*128, 2*inter] (packed order), or nullptr: not stored
  int64_t hidden = 0, inter = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
  // Optional (device, [experts]): each expert's first routed row (the first row of its first
  // 128-row tile: its segment in the padded layout above, as the schedule's expert_offset) and
  // its token rows. Rows of a tile past its expert's tokens are padding: with these, nearly
  // empty tiles cost about half, and the outputs of padding rows 64-127 of such tiles are left
  // unwritten (padding rows of the outputs are undefined either way).
  const int32_t* expert_row_begin = nullptr;
  const int32_t* expert_rows = nullptr;
};

// FC2 forward (and any "rows times transposed weights"): y[r] = a[r] . W[e]^T.
struct Fc2Args {
  const void* a = nullptr;  // [num_m_tiles*128, k]  (FC2: h, k = inter)
  const void* w = nullptr;  // [experts, n, k]       (FC2: w_down, n = hidden)
  void* y = nullptr;        // [num_m_tiles*128, n]
  int64_t k = 0, n = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
  const int32_t* expert_row_begin = nullptr;  // optional, as in Fc1Args
  const int32_t* expert_rows = nullptr;
};

// Dgrad: dx[r] = dy[r] . W[e] with W untransposed ([experts, k, n], n contiguous: MN-major B).
// FC2's dgrad: dy = d_y, W = w_down [E, hidden, inter] -> d_h. FC1's: dy = d_gu (packed order,
// k = 2*inter), w = w_gate and w_up = w_up (each [E, inter, hidden]) -> d_x: the K blocks of the
// packed order are read from the two tensors where they are.
// The reverse dispatch fused into a dgrad's epilogue (plan_dgrad_scatter, plan_fp8_grouped_scatter;
// the layer's FC1 dgrad in bf16 and FP8):
// output row r of the call (schedule row g = row_base + r) is stored at to[src_rank[g]] +
// src_slot[g] * n (bf16) instead of into dx, i.e. straight into its token's slot of the owner's
// combine window, which may be a peer's memory over NVLink (mok::gpu::push_combine's copy without
// the dense rows in between). src_rank / src_slot are the routed schedule's device tables; rows
// with src_rank < 0 (padding) are not stored. Nothing is stored once *abort (optional, the
// communicator's abort word) is nonzero. to: device array of the ranks' windows, each 16-byte
// aligned; n a multiple of 8.
struct RowScatter {
  const int32_t* src_rank = nullptr;
  const int32_t* src_slot = nullptr;
  void* const* to = nullptr;  // active when given
  int64_t row_base = 0;
  const uint32_t* abort = nullptr;
};

// Routed rows copied beside a GEMM by the idle warps of its producer warpgroup (warps 1-3 of every
// CTA; warp 0 issues the GEMM's loads), while its consumers run the MMAs: the layer's backward
// pulls a window's x rows for dW_gate/up this way beside FC2's dgrad (DgradSwiGLUArgs::pull),
// instead of in a kernel of their own before it. For every routed row g in [row_begin,
// min(row_end, *total_rows)) (row_end < 0: to *total_rows): to[g - row_begin] =
// from[src_rank[g]][src_slot[g] / top_k], n bf16 elements a row (the token's row of its owner's
// window, maybe a peer's over NVLink), zeros where src_rank[g] < 0 (padding): the bits of
// mok::gpu::pull_dispatch. Nothing more moves once *abort (optional) is nonzero. The rows are
// complete when the GEMM's kernel is (stream order). from's rows and `to` 16-byte aligned; n a
// multiple of 8. (FC2's dgrad only: in the weight gradients the same code made ptxas spill.)
struct RowPull {
  const int32_t* src_rank = nullptr;
  const int32_t* src_slot = nullptr;
  const int32_t* total_rows = nullptr;  // device: the schedule's padded row count
  const void* const* from = nullptr;     // device array of the ranks' windows
  void* to = nullptr;                    // active when given
  int64_t row_begin = 0, row_end = -1, n = 0, top_k = 1;
  const uint32_t* abort = nullptr;
};

struct DgradArgs {
  const void* dy = nullptr;  // [num_m_tiles*128, k]
  const void* w = nullptr;   // [experts, k, n], or with w_up: w_gate [experts, k/2, n]
  void* dx = nullptr;        // [num_m_tiles*128, n] (unused by plan_dgrad_scatter: may be null)
  int64_t k = 0, n = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
  const void* w_up = nullptr;  // optional: FC1's dgrad, see above (k a multiple of 64)
};

// FC2's dgrad fused with the SwiGLU backward (the backward of h = silu(g) * u): with
// d_h = rnd(d_y[r] . w_down[e]) (kept in registers, never stored) and the forward's packed gate/up
// pre-activations gu[r] (FC1's `gu` output, packed order), writes d_gu[r] in the same order:
// d_u = rnd(g * s * d_h), d_g = rnd(s * (1 + g * (1 - s)) * u * d_h), s = sigmoid(g) (the rounding
// points of ref::Engine's backward). d_gu is what FC1's dgrad (d_x = d_gu . [W_gate; W_up]) and
// wgrad (dW_gate, dW_up from d_gu^T x) take. d_gu may be gu itself (in place). Padding rows of
// d_gu are undefined. inter must be a multiple of 32.
struct DgradSwiGLUArgs {
  const void* dy = nullptr;      // [num_m_tiles*128, hidden] (d_y, already weighted; see row_weight)
  const void* w_down = nullptr;  // [experts, hidden, inter]
  const void* gu = nullptr;      // [num_m_tiles*128, 2*inter], packed order
  void* d_gu = nullptr;          // [num_m_tiles*128, 2*inter], packed; may equal gu
  int64_t hidden = 0, inter = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
  // Optional, together: dy holds the routed rows' unweighted d_out rows and row_weight [rows] f32
  // their router weights; then d_h = rnd(w * rnd(g)) with g = d_out . W_down, router_partial
  // [rows, router_parts(inter)] f32 receives the router-weight gradient <rnd(g), h> of each row
  // in sums of 64 intermediate columns (sum them in increasing order: that is the gradient's
  // definition, include/mok/reference.hpp), with h = rnd(silu(g) * u) computed here from gu (the
  // bits of FC1's epilogue), and h [rows, inter] bf16 (dense, written only) receives rnd(w * h):
  // dW_down's operand. So the backward needs the forward's gate/up rows, not its h.
  const float* row_weight = nullptr;
  float* router_partial = nullptr;
  void* h = nullptr;
  // Optional (pull.to given): rows copied beside this GEMM by its idle producer warps (RowPull).
  RowPull pull{};
};


// Wgrad (K-grouped): dw[e] = sum over expert e's rows r of a[r]^T b[r], i.e. [m, n] per expert,
// fp32 sums in increasing row order, rounded to bf16. Rows past expert_rows[e] inside the padded
// segment are ignored whatever they hold. Experts without rows get dw[e] = 0.
// With dw_up given, a's m columns are in packed gate/up order (e.g. d_gu; m a multiple of 64) and
// the gradient is written unpacked: its gate rows to dw and its up rows to dw_up, each
// [experts, m / 2, n] (dW_gate and dW_up, the same bits as the packed rows), so no unpacking pass
// is needed.
struct WgradArgs {
  const void* a = nullptr;  // [rows_total, m]  (e.g. d_y for dW_down, d_gu for dW_gate/dW_up)
  const void* b = nullptr;  // [rows_total, n]  (e.g. h, x)
  void* dw = nullptr;       // [experts, m, n]
  int64_t m = 0, n = 0, experts = 0, rows_total = 0;
  const int32_t* expert_row_begin = nullptr;  // [experts] (device)
  const int32_t* expert_rows = nullptr;       // [experts] (device)
  void* dw_up = nullptr;                      // optional: see above
  // A gradient whose rows come in several calls (the backward's macrobatches), with the bits of
  // one call over all rows: each call gives its part of every expert's rows (expert_row_begin /
  // expert_rows; K-block aligned: a part starts 64 * j rows after the expert's first row), in
  // order. carry_experts (device, {in, out}, -1 = none): expert `in` continues the fp32 sums a
  // previous call left in `carry_in` instead of starting from 0; expert `out` continues in a later
  // call, so its fp32 sums go to `carry_out` instead of dw (in == out when its rows span three or
  // more calls). Two buffers of wgrad_carry_floats(m, n) floats (device, one expert's worth
  // each), which must not overlap: tiles of `in` read while tiles of `out` write, unordered; the
  // next call takes this one's carry_out as its carry_in (alternate the two).
  // expert_rows_total (device, [experts], optional): an expert without rows in this call is
  // written as 0 only if it has no rows at all (else another call writes it).
  const float* carry_in = nullptr;
  float* carry_out = nullptr;
  const int32_t* carry_experts = nullptr;
  const int32_t* expert_rows_total = nullptr;
  // expert_range (device, {first, count}, optional): only experts [first, first + count) are
  // scheduled (the others' gradients left alone): a call over a window of the rows runs the tiles
  // of the experts it touches, not empty tiles of every expert. Clamped to [0, experts).
  const int32_t* expert_range = nullptr;
  // Held rows (the backward over windows: an expert cut by a window's end is run by the next
  // window over the rows the cutting one kept aside, instead of carrying its fp32 sums): an expert
  // whose expert_row_begin is negative starts with held rows. Its tiles' K rows k < 0 are read from
  // hold_a's row hold_a_row + k ([hold_a_rows, m]) and hold_b's row hold_b_row + k ([hold_b_rows,
  // n]), then its rows here from 0 on: one K order, the sums of one call over all its rows. Held
  // rows are whole 128-row tiles, at most hold_a_row and hold_b_row of them. All given or none.
  const void* hold_a = nullptr;
  const void* hold_b = nullptr;
  int64_t hold_a_rows = 0, hold_b_rows = 0, hold_a_row = 0, hold_b_row = 0;
  // Gradient accumulation (training stacks keep an fp32 `main_grad` per weight): dw (and dw_up)
  // are fp32 and each expert's fp32 sums are added to them, dw += a_e^T . b_e, instead of being
  // written as bf16 (no rounding to bf16 on the way). The tile that owns an element adds to it
  // once, by a TMA reduce-add (the add done in L2: 8 bytes of traffic per element, the fp32
  // read-modify-write, against the bf16 store's 2): deterministic, v + sum with one fp32
  // rounding. With carry, the call that finishes an expert adds it; an expert without rows is
  // left as it is. dw / dw_up 16-byte aligned.
  bool accumulate = false;
};

// What a Plan holds. Its fields are filled by plan_* and read by run(); they are public because a
// Plan is a plain value (built once, copied into the caller's state, launched without any
// allocation or lookup), not because callers should set them. The kernels read KernelParams as
// is (src/gemm/grouped_kernel.cuh), so its layout is shared by host and device code.
enum class Form : int {
  Fc1SwiGLU = 0,  // gu = x . [W_gate[e]; W_up[e]]^T (packed order), h = silu(g) * u
  Plain = 1,      // out = a . W[e]^T, W [E, N, K] (FC2 forward)
  Dgrad = 2,      // out = a . W[e], W [E, K, N] (MN-major B)
  Wgrad = 3,      // dw[e] = a_e^T . b_e over expert e's rows (K-grouped, both operands MN-major)
  DgradSwiGLU = 4,  // FC2's dgrad fused with the SwiGLU backward: d_gu from dy . W_down[e] and gu
  Fp8Plain = 5,     // out = a . W[e]^T with block-scaled E4M3 operands (Fp8GroupedArgs)
  Fp8Fc1 = 6,       // FC1 + SwiGLU with block-scaled E4M3 operands, h out as E4M3 1x128 (Fp8Fc1Args)
  Fp8Wgrad = 7,     // dw[e] = a_e^T . b_e from token-block-scaled E4M3 operands (Fp8WgradArgs)
  Fp8DgradSwiGLU = 8,  // DgradSwiGLU with block-scaled E4M3 d_y and W_down^T (Fp8DgradSwiGLUArgs)
  DgradScatter = 9,    // Dgrad whose rows go to their slots (plan_dgrad_scatter)
};

struct KernelParams {
  int32_t num_m_tiles = 0;  // M-grouped: 128-row tiles of the routed buffer; Wgrad: M tiles per expert
  int32_t n_tiles = 0;      // 256-column output tiles
  int32_t k_blocks = 0;     // M-grouped: 64-wide K blocks
  int32_t n = 0;            // output columns (FC1: 2*inter, the packed gate/up width)
  int32_t m_out = 0;        // Wgrad: output rows per expert
  int32_t experts = 0;      // Wgrad: experts
  int32_t group_m = 8;      // tile raster: M tiles per group (N outer, M inner inside a group)
  int32_t group_experts = 0;  // M-grouped: groups split at expert boundaries (Options::group_experts)
  int32_t store_gu = 1;     // FC1: also store the gate/up pre-activations
  int32_t skew_stages = 0;  // stagger of the consumer warpgroups in K blocks (0: off, <= 4)
  const int32_t* tile_expert = nullptr;       // M-grouped: [num_m_tiles], -1 = skip the tile
  // Wgrad: [experts] first routed row and valid rows of each expert. FC1/FC2 (optional): with
  // them, a tile whose tokens fit in its first 64 rows runs in split-N form.
  const int32_t* expert_row_begin = nullptr;
  const int32_t* expert_rows = nullptr;
  // FC1: h, dense [rows, n/2] bf16 (split-N tiles at BLOCK_N 128 store to it directly);
  // DgradSwiGLU with row_weight: h, dense [rows, n] bf16, written rnd(w * silu(g) * u).
  void* fc1_h = nullptr;
  const void* gu = nullptr;  // DgradSwiGLU: the forward's packed gate/up pre-activations, dense [rows, 2n] bf16
  // DgradSwiGLU with unweighted rows (DgradSwiGLUArgs::row_weight): [rows] router weights, and
  // [rows, router_parts] partial sums of the router-weight gradient.
  const float* row_weight = nullptr;
  float* router_partial = nullptr;
  int32_t router_parts = 0;
  // Wgrad: the output rows are packed gate/up rows (m_out = 2I): map_d0 receives the gate rows and
  // map_d1 the up rows, each [experts, m_out / 2, n] in plain order (epilogue_store_gate_up).
  int32_t split_gate_up = 0;
  // Dgrad: B is a gate/up pair (FC1's dgrad): map_b is w_gate's, map_b_half w_up's (32-row boxes),
  // and K runs over the packed order (engine_mainloop.cuh's produce_tile). FC1 always reads so.
  int32_t b_gate_up = 0;
  // Wgrad across calls (WgradArgs::carry): fp32 partial sums of one expert, [tiles][256 threads]
  // in the accumulators' order; {carry in, carry out} experts; every expert's rows over all calls.
  const float* carry_in = nullptr;
  float* carry_out = nullptr;
  const int32_t* carry_experts = nullptr;
  const int32_t* expert_rows_total = nullptr;
  const int32_t* expert_range = nullptr;      // Wgrad: {first, count} experts scheduled (optional)
  // Wgrad with held rows (WgradArgs::hold_*): K rows k < 0 from map_a_hold / map_b_hold at rows
  // k + hold_a_row / k + hold_b_row.
  int32_t hold = 0, hold_a_row = 0, hold_b_row = 0;
  // Wgrad with WgradArgs::accumulate: map_d0 / map_d1 are fp32 (F32Tile) and the epilogue
  // reduce-adds into them (FormWgradAccumulate).
  int32_t wgrad_accumulate = 0;
  // DgradScatter (plan_dgrad_scatter): the rows' destinations, as RowScatter.
  const int32_t* scatter_rank = nullptr;
  const int32_t* scatter_slot = nullptr;
  void* const* scatter_to = nullptr;
  const uint32_t* scatter_abort = nullptr;
  int64_t scatter_row_base = 0;
  // DgradSwiGLU with DgradSwiGLUArgs::pull: the rows the idle producer warps copy, as RowPull.
  const int32_t* pull_rank = nullptr;
  const int32_t* pull_slot = nullptr;
  const int32_t* pull_total = nullptr;
  const void* const* pull_from = nullptr;
  void* pull_to = nullptr;
  const uint32_t* pull_abort = nullptr;
  int64_t pull_row_begin = 0, pull_row_end = -1;
  int32_t pull_vecs = 0, pull_top_k = 1;
  unsigned int* error = nullptr;              // bounded waits: error word (nullptr: unbounded)
  unsigned long long wait_limit_ns = 0;
  // Fp8Plain: fp32 scales of A [rows, k_blocks] and of the weights [experts, n / 128, k_blocks]
  // (k_blocks: 128 K elements each).
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  const float* scale_b_up = nullptr;  // Fp8Fc1: W_up's [experts, inter / 128, k_blocks]
  float* scale_h = nullptr;           // Fp8Fc1: h's [rows, inter / 128] (fc1_h: its E4M3 codes)
  int32_t h_mx = 0;                   // Fp8Fc1: h as MXFP8 re-blocked to 1 x 128 (Fp8Fc1Args::h_mx)
  void* fc1_gu = nullptr;             // Fp8Fc1: optional packed gate/up store (Fp8Fc1Args::gu)
  // Fp8Wgrad: its scales (one per 128 x 1 block) come through Plan::map_sa / map_sb, not these.
};

// Block-scaled FP8 (issue 22, recipe 1): y[r] = a[r] . W[e]^T for the routed rows r of expert e,
// with a and W given as E4M3 codes and fp32 scales — a's per row and 128 K elements (1 x 128
// blocks), W's per 128 x 128 block of each expert's [n, k] (src/gemm/fp8_quantize.h makes both) —,
// the tensor cores' products over each 128 of K promoted into fp32 with both scales, y bf16.
// k and n multiples of 128; tiles 128 or 256 wide (Options::block_n, 0 = by tile count), no clusters.
struct Fp8GroupedArgs {
  const void* a = nullptr;          // [num_m_tiles*128, k] E4M3 codes
  const float* a_scales = nullptr;  // [num_m_tiles*128, k / 128]
  const void* w = nullptr;          // [experts, n, k] E4M3 codes
  const float* w_scales = nullptr;  // [experts, n / 128, k / 128]
  void* y = nullptr;                // [num_m_tiles*128, n] bf16
  int64_t k = 0, n = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
};

// FC1 in FP8 (issue 22, recipe 1): g, u = x[r] . W_gate[e]^T, x[r] . W_up[e]^T from block-scaled
// E4M3 operands (x per 1 x 128, each weight per 128 x 128, fp32 scales), h = rnd(silu(rnd(g)) *
// rnd(u)) (FC1's SwiGLU bits), written as FC2's operand: E4M3 codes with one fp32 scale per row
// and 128 intermediate columns (amax / 448). The gate/up pre-activations are stored only when `gu`
// is given (a forward that saves for the FP8 backward's SwiGLU'). hidden and inter multiples of
// 128; 256-wide packed tiles (128 intermediate columns: one h block per row), no clusters.
struct Fp8Fc1Args {
  const void* x = nullptr;               // [num_m_tiles*128, hidden] E4M3 codes
  const float* x_scales = nullptr;       // [num_m_tiles*128, hidden / 128]
  const void* w_gate = nullptr;          // [experts, inter, hidden] E4M3 codes
  const float* w_gate_scales = nullptr;  // [experts, inter / 128, hidden / 128]
  const void* w_up = nullptr;            // [experts, inter, hidden] E4M3 codes
  const float* w_up_scales = nullptr;    // [experts, inter / 128, hidden / 128]
  void* h = nullptr;                     // [num_m_tiles*128, inter] E4M3 codes
  float* h_scales = nullptr;             // [num_m_tiles*128, inter / 128]
  // Optional: [num_m_tiles*128, 2*inter] bf16 in the packed order, rnd(g) and rnd(u) as the bf16
  // FC1 stores them (FcArgs::gu): the gate/up rows the backward's SwiGLU' reads. 4-byte aligned.
  void* gu = nullptr;
  int64_t hidden = 0, inter = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
  // h as MXFP8 re-blocked to its 1 x 128 blocks (recipe 2 on the FP8 forms, notes/fp8.md "MXFP8
  // on Hopper"): the codes and power-of-two scales gemm::quantize_mxfp8_reblocked would give h.
  // (GPU test: Fp8Grouped.Fc1WithMxHMatchesTheReference.)
  bool h_mx = false;
};

// The FP8 backward's weight gradient (issue 22, recipe 1): dw[e] = a_e^T . b_e over expert e's
// routed rows, where K is the rows (tokens), so both operands are scaled per 128 x 1 block — 128
// consecutive rows of one column, i.e. one 128-row M tile of the expert's segment — and given
// transposed (K-major, as FP8 wgmma reads them): gemm::quantize_fp8_token_blocks_t makes both
// (src/gemm/fp8_quantize.h), its padding rows zero. Each 128-row block's products are promoted in
// fp32 with the scale of the output row's block and the output column's. Every expert's segment
// with rows begins at a multiple of 128 rows (the routed layout's padding; a kernel finding one
// that does not records kSiteFp8Segment in Options::error, and the call's results are undefined,
// as after an expired wait). With
// dw_up, m_out is a packed gate/up width (FC1's [d_g d_u] in the packed order) and the gate rows go
// to dw, the up rows to dw_up (each [experts, m_out / 2, n]), as WgradArgs does. No carry across
// calls (one call over all of the rows); m_out and n multiples of 128; the scales 16-byte aligned.
struct Fp8WgradArgs {
  const void* a_t = nullptr;          // [m_out, ld] E4M3 codes, ld = rows_total rounded up to 128
  const float* a_scales = nullptr;    // [ld / 128, m_out]
  const void* b_t = nullptr;          // [n, ld] E4M3 codes
  const float* b_scales = nullptr;    // [ld / 128, n]
  void* dw = nullptr;                 // [experts, m_out, n] bf16 (with dw_up: the gate rows)
  void* dw_up = nullptr;              // optional: the up rows, [experts, m_out / 2, n]
  int64_t m_out = 0, n = 0, experts = 0;
  int64_t rows_total = 0;             // routed rows the codes cover (before the rounding up)
  const int32_t* expert_row_begin = nullptr;  // device [experts]: first routed row (a multiple of 128)
  const int32_t* expert_rows = nullptr;       // device [experts]: valid rows
  const int32_t* expert_range = nullptr;      // optional, as WgradArgs::expert_range
  // Optional, as WgradArgs's (a backward over windows of the routed rows): the carried expert's
  // fp32 sums, continued from carry_in / left in carry_out, in the same order of K blocks as one
  // call over all rows (the same bits); expert_rows_total keeps other calls' experts unwritten.
  const float* carry_in = nullptr;
  float* carry_out = nullptr;
  const int32_t* carry_experts = nullptr;
  const int32_t* expert_rows_total = nullptr;
};
// FC2's dgrad fused with the SwiGLU backward in FP8 (issue 22, recipe 1): d_h = d_y . W_down[e]
// from E4M3 operands — d_y per 1 x 128 along hidden, W_down transposed ([experts, inter, hidden],
// K-major, as FP8 wgmma reads it) per 128 x 128 block, the same codes and scales as the forward's
// W_down blocks transposed (gemm::transpose_weights_bf16 then quantize_fp8_blocked make them from
// the bf16 weights) — then DgradSwiGLUArgs's epilogue, unchanged: d_gu bf16 in the packed order,
// and with row_weight the router-weight gradient's partial sums and rnd(w * h), h = rnd(silu(g) u)
// from gu in bf16 (the recipe's backward uses the bf16 h, not its FP8 rounding: include/mok/
// reference.hpp). hidden and inter multiples of 128; 256-wide tiles; no clusters.
struct Fp8DgradSwiGLUArgs {
  const void* dy = nullptr;              // [num_m_tiles*128, hidden] E4M3 codes
  const float* dy_scales = nullptr;      // [num_m_tiles*128, hidden / 128]
  const void* w_down_t = nullptr;        // [experts, inter, hidden] E4M3 codes
  const float* w_down_t_scales = nullptr;  // [experts, inter / 128, hidden / 128]
  const void* gu = nullptr;              // [num_m_tiles*128, 2*inter] bf16, packed order
  void* d_gu = nullptr;                  // [num_m_tiles*128, 2*inter] bf16, packed; may equal gu
  int64_t hidden = 0, inter = 0, experts = 0;
  const int32_t* tile_expert = nullptr;
  int64_t num_m_tiles = 0;
  const float* row_weight = nullptr;     // as DgradSwiGLUArgs
  float* router_partial = nullptr;
  void* h = nullptr;
};

// The site a K-grouped FP8 kernel records when an expert's segment is not 128-row aligned.
constexpr unsigned int kSiteFp8Segment = 0x6e04;
// The site the bf16 weight gradient records when an expert starts more rows before its call's
// rows than the hold has (WgradArgs::hold_*, or no hold at all): that expert is not computed.
constexpr unsigned int kSiteHeldRows = 0x6e05;

struct Plan {
  Form form = Form::Plain;
  // map_b_half: the K-major B map with a box of BLOCK_N/2 rows (clusters); with a gate/up B
  // (FC1, FC1's dgrad) the up map, map_b then being the gate map.
  CUtensorMap map_a{}, map_b{}, map_b_half{}, map_d0{}, map_d1{};
  // The FP8 wgrad's scale maps (fp32, one K block's run of scales per load, loaded with the
  // stage's operands): A's row scales and B's column scales. Unused by the other forms.
  CUtensorMap map_sa{}, map_sb{};
  // The bf16 weight gradient's held rows (WgradArgs::hold_a / hold_b). Unused by the other forms.
  CUtensorMap map_a_hold{}, map_b_hold{};
  KernelParams params{};
  int block_n = 256;     // tile width of the kernel that runs
  bool cluster = false;  // 2-CTA clusters (grid is even)
  bool pdl = false;      // launched with programmatic stream serialization (Options::pdl)
  int grid = 0;       // 0: nothing to do
  // Useful work in FLOPs for the padded problem (2 * rows * n * k), for reporting.
  double padded_flops = 0;
};

Plan plan_fc1(const Fc1Args& a, const Options& o = {});
Plan plan_fc2(const Fc2Args& a, const Options& o = {});
Plan plan_dgrad(const DgradArgs& a, const Options& o = {});
Plan plan_dgrad_scatter(const DgradArgs& a, const RowScatter& to, const Options& o = {});  // (a.dx unused)
Plan plan_dgrad_swiglu(const DgradSwiGLUArgs& a, const Options& o = {});
Plan plan_wgrad(const WgradArgs& a, const Options& o = {});
Plan plan_fp8_grouped(const Fp8GroupedArgs& a, const Options& o = {});
Plan plan_fp8_grouped_scatter(const Fp8GroupedArgs& a, const RowScatter& to, const Options& o = {});  // (a.y unused)
Plan plan_fp8_fc1(const Fp8Fc1Args& a, const Options& o = {});
Plan plan_fp8_wgrad(const Fp8WgradArgs& a, const Options& o = {});
Plan plan_fp8_dgrad_swiglu(const Fp8DgradSwiGLUArgs& a, const Options& o = {});
// Launches the plan's kernel on `stream` (asynchronous; nothing when grid == 0).
void run(const Plan& plan, cudaStream_t stream);

// Shared memory the kernel of a plan uses (bytes per CTA; every form but the FP8 wgrad, whose
// stages also carry scales).
int smem_bytes(int block_n);
// The tile width plan_* picks for `m_tiles` 128-row tiles (times experts for wgrad) and n output
// columns on `sms` SMs: 128 when 256-wide tiles would leave too much of the last wave idle.
int choose_block_n(int64_t m_tiles, int64_t n, int sms);

// The packed order on the host, on bf16 bit patterns: w_gate, w_up [experts, inter, hidden] ->
// w1p [experts, 2*inter, hidden] with row packed_gate_row(i) = gate row i, packed_up_row(i) = up
// row i (what FC1's B tile holds; for references and tests: the kernels take w_gate and w_up).
void pack_gate_up_host(const uint16_t* w_gate, const uint16_t* w_up, uint16_t* w1p, int64_t experts,
                       int64_t inter, int64_t hidden);

}  // namespace mok::gemm
