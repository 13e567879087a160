// mok — grouped GEMM plans (host side): validation, tensor maps, grid.
#include "mok/gemm.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "gemm/launchers.h"
#include "gemm/tensor_map.h"
#include "mok/errors.hpp"

namespace mok::gemm {
namespace {

constexpr int64_t kBlockM = 128, kBlockK = 64;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int sm_count() {
  int dev = 0, sms = 0;
  MOK_CUDA_CHECK(cudaGetDevice(&dev));
  MOK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// Picks the tile width (Options.block_n or the heuristic) and the number of N tiles.
void pick_block_n(Plan& p, const Options& o, int64_t m_tiles, int64_t n) {
  MOK_REQUIRE(o.block_n == 0 || o.block_n == 128 || o.block_n == 256, "options.block_n",
              "0 (auto), 128 or 256, got ", o.block_n);
  p.block_n = o.block_n ? o.block_n : choose_block_n(m_tiles, n, sm_count());
  p.params.n_tiles = static_cast<int32_t>(cdiv(n, p.block_n));
}

// tiles: output tiles; pair_units: units of the 2-CTA cluster schedule (pairs of M tiles x N tiles).
void fill_common(Plan& p, const Options& o, int64_t tiles, int64_t pair_units) {
  MOK_REQUIRE(o.group_m >= 1, "options.group_m", ">= 1, got ", o.group_m);
  MOK_REQUIRE(o.max_ctas >= 0, "options.max_ctas", ">= 0, got ", o.max_ctas);
  MOK_REQUIRE(tiles < (int64_t(1) << 31), "problem size", "fewer than 2^31 output tiles");
  MOK_REQUIRE(o.skew_stages >= -1 && o.skew_stages <= 4, "options.skew_stages", "0..4 or -1 (the form's), got ",
              o.skew_stages);
  MOK_REQUIRE(p.params.n_tiles > 0, "plan", "n_tiles must be set before fill_common");
  p.params.group_m = o.group_m;
  p.params.group_experts = o.group_experts ? 1 : 0;
  const bool fp8 = p.form == Form::Fp8Plain || p.form == Form::Fp8Fc1 || p.form == Form::Fp8Wgrad ||
                   p.form == Form::Fp8DgradSwiGLU;
  p.params.skew_stages = o.skew_stages >= 0 ? o.skew_stages : (fp8 ? kFp8DefaultSkew : 0);
  p.params.error = o.error;
  p.params.wait_limit_ns = static_cast<unsigned long long>(o.wait_limit_s * 1e9);
  const int64_t ctas = o.max_ctas > 0 ? o.max_ctas : sm_count();
  p.cluster = o.cluster;
  p.pdl = o.pdl;
  if (o.cluster) {
    MOK_REQUIRE(ctas >= 2, "options.max_ctas", ">= 2 with clusters, got ", ctas);
    p.grid = static_cast<int>(2 * std::min<int64_t>(ctas / 2, pair_units));
  } else {
    p.grid = static_cast<int>(std::min<int64_t>(ctas, tiles));
  }
}

void require_dims(int64_t k, int64_t n, const char* what) {
  MOK_REQUIRE(k >= 1 && k % 8 == 0, what, "K must be a positive multiple of 8, got ", k);
  MOK_REQUIRE(n >= 1 && n % 8 == 0, what, "N must be a positive multiple of 8, got ", n);
  MOK_REQUIRE(k < (int64_t(1) << 31) && n < (int64_t(1) << 31), what, "dims below 2^31");
}

void require_routed(const int32_t* tile_expert, int64_t num_m_tiles, int64_t experts, const char* what) {
  MOK_REQUIRE(num_m_tiles >= 0 && num_m_tiles * kBlockM < (int64_t(1) << 31), what,
              "0 <= num_m_tiles*128 < 2^31, got num_m_tiles = ", num_m_tiles);
  MOK_REQUIRE(num_m_tiles == 0 || tile_expert != nullptr, what, "tile_expert must be given");
  MOK_REQUIRE(experts >= 1, what, "experts >= 1, got ", experts);
}

// The reverse dispatch's destinations (plan_dgrad_scatter, plan_fp8_grouped_scatter) into p.
void set_scatter(Plan& p, const RowScatter& sc, const std::string& what) {
  MOK_REQUIRE(sc.to != nullptr && sc.src_rank != nullptr && sc.src_slot != nullptr, what + ".to",
              "to, src_rank and src_slot must be given");
  MOK_REQUIRE(sc.row_base >= 0, what + ".row_base", ">= 0, got ", sc.row_base);
  p.params.scatter_rank = sc.src_rank;
  p.params.scatter_slot = sc.src_slot;
  p.params.scatter_to = sc.to;
  p.params.scatter_abort = sc.abort;
  p.params.scatter_row_base = sc.row_base;
}

}  // namespace

int smem_bytes(int block_n) { return engine_smem_bytes(block_n); }  // (engine::Cfg asserts it)

int choose_block_n(int64_t m_tiles, int64_t n, int sms) {
  // Time in units of one 256-wide tile: whole waves of tiles; a 128-wide tile costs a bit more
  // than half of a 256-wide one (fixed per-tile work, lower operand reuse).
  const double waves256 = double(cdiv(m_tiles * cdiv(n, 256), sms));
  const double waves128 = double(cdiv(m_tiles * cdiv(n, 128), sms)) * 0.55;
  return waves128 < waves256 ? 128 : 256;
}

// What every M-grouped plan (FC1, FC2, dgrad, dgrad + SwiGLU backward) shares: validation of the
// routed layout, tile counts, grid and FLOPs. The caller adds its form-specific parameters and
// tensor maps.
Plan m_grouped_plan(Form form, int64_t k, int64_t n, int64_t experts, const int32_t* tile_expert,
                    int64_t num_m_tiles, const Options& o, const char* what) {
  require_dims(k, n, what);
  require_routed(tile_expert, num_m_tiles, experts, what);
  Plan p;
  p.form = form;
  p.params.num_m_tiles = static_cast<int32_t>(num_m_tiles);
  pick_block_n(p, o, num_m_tiles, n);
  p.params.k_blocks = static_cast<int32_t>(cdiv(k, kBlockK));
  p.params.n = static_cast<int32_t>(n);
  p.params.tile_expert = tile_expert;
  fill_common(p, o, num_m_tiles * p.params.n_tiles, cdiv(num_m_tiles, 2) * p.params.n_tiles);
  p.padded_flops = 2.0 * double(num_m_tiles * kBlockM) * double(n) * double(k);
  return p;
}

// Split-N for nearly empty tiles needs each tile's token rows (from the experts' rows).
void set_split_n(Plan& p, const Options& o, const int32_t* row_begin, const int32_t* rows) {
  MOK_REQUIRE((row_begin == nullptr) == (rows == nullptr), "expert_row_begin/expert_rows",
              "must be given together (or neither)");
  if (!o.split_n || rows == nullptr) return;
  p.params.expert_row_begin = row_begin;
  p.params.expert_rows = rows;
}

// FC1's B from the gate and up weights where they are: 32-row boxes, packed order (mok/gemm.hpp).
void gate_up_maps(Plan& p, const void* w_gate, const void* w_up, int64_t experts, int64_t inter, int64_t hidden) {
  const auto box = static_cast<uint32_t>(kGateUpGroup);
  p.map_b = make_map_3d(w_gate, uint64_t(experts), uint64_t(inter), uint64_t(hidden), box);
  p.map_b_half = make_map_3d(w_up, uint64_t(experts), uint64_t(inter), uint64_t(hidden), box);
}

Plan plan_fc1(const Fc1Args& a, const Options& o) {
  MOK_REQUIRE(a.inter % kGateUpGroup == 0, "fc1.inter", "multiple of ", kGateUpGroup, " (gate/up order), got ",
              a.inter);
  MOK_REQUIRE(a.x && a.w_gate && a.w_up && a.h, "fc1", "x, w_gate, w_up and h must be given");
  const int64_t rows = a.num_m_tiles * kBlockM, n = 2 * a.inter;
  Plan p = m_grouped_plan(Form::Fc1SwiGLU, a.hidden, n, a.experts, a.tile_expert, a.num_m_tiles, o, "fc1");
  p.params.store_gu = a.gu != nullptr;
  p.params.fc1_h = a.h;
  set_split_n(p, o, a.expert_row_begin, a.expert_rows);
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(rows);
  p.map_a = make_map_2d(a.x, u, uint64_t(a.hidden), 128);
  gate_up_maps(p, a.w_gate, a.w_up, a.experts, a.inter, a.hidden);
  p.params.b_gate_up = 1;
  p.map_d1 = make_map_2d(a.h, u, uint64_t(a.inter), 64);
  p.map_d0 = a.gu ? make_map_2d(a.gu, u, uint64_t(n), 64) : p.map_d1;
  return p;
}

Plan plan_fc2(const Fc2Args& a, const Options& o) {
  MOK_REQUIRE(a.a && a.w && a.y, "fc2", "a, w and y must be given");
  const int64_t rows = a.num_m_tiles * kBlockM;
  Plan p = m_grouped_plan(Form::Plain, a.k, a.n, a.experts, a.tile_expert, a.num_m_tiles, o, "fc2");
  set_split_n(p, o, a.expert_row_begin, a.expert_rows);
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(rows);
  p.map_a = make_map_2d(a.a, u, uint64_t(a.k), 128);
  p.map_b = make_map_3d(a.w, uint64_t(a.experts), uint64_t(a.n), uint64_t(a.k), uint32_t(p.block_n));
  p.map_b_half = make_map_3d(a.w, uint64_t(a.experts), uint64_t(a.n), uint64_t(a.k), uint32_t(p.block_n / 2));
  p.map_d0 = make_map_2d(a.y, u, uint64_t(a.n), 64);
  p.map_d1 = p.map_d0;
  return p;
}

namespace {
// plan_dgrad and plan_dgrad_scatter: sc null for the dense rows.
Plan dgrad_plan(const DgradArgs& a, const RowScatter* sc, const Options& o) {
  const bool scatter = sc != nullptr;
  MOK_REQUIRE(a.dy && a.w && (a.dx || scatter), "dgrad", "dy and w (and dx, unless scattered) must be given");
  MOK_REQUIRE(a.w_up == nullptr || a.k % (2 * kGateUpGroup) == 0, "dgrad.k",
              "a multiple of 64 with w_up (whole groups of the gate/up order), got ", a.k);
  const int64_t rows = a.num_m_tiles * kBlockM;
  Plan p = m_grouped_plan(scatter ? Form::DgradScatter : Form::Dgrad, a.k, a.n, a.experts, a.tile_expert,
                          a.num_m_tiles, o, scatter ? "dgrad_scatter" : "dgrad");
  if (scatter) set_scatter(p, *sc, "dgrad_scatter");
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(rows);
  p.map_a = make_map_2d(a.dy, u, uint64_t(a.k), 128);
  if (a.w_up != nullptr) {
    gate_up_maps(p, a.w, a.w_up, a.experts, a.k / 2, a.n);  // {n, k/2, e} each, 32 k rows per box
    p.params.b_gate_up = 1;
  } else {
    p.map_b = make_map_3d(a.w, uint64_t(a.experts), uint64_t(a.k), uint64_t(a.n), 64);  // {n, k, e}
    p.map_b_half = p.map_b;  // MN-major B is loaded in 64-column chunks either way
  }
  // (scattered: no output map; the consumers' prefetch gets a valid one)
  p.map_d0 = scatter ? p.map_a : make_map_2d(a.dx, u, uint64_t(a.n), 64);
  p.map_d1 = p.map_d0;
  return p;
}
}  // namespace

Plan plan_dgrad(const DgradArgs& a, const Options& o) { return dgrad_plan(a, nullptr, o); }
Plan plan_dgrad_scatter(const DgradArgs& a, const RowScatter& to, const Options& o) { return dgrad_plan(a, &to, o); }

// The dgrad + SwiGLU backward epilogue's operands (both precisions): checks and parameters.
void set_dgrad_swiglu(Plan& p, const void* gu, const void* d_gu, const float* row_weight, float* router_partial,
                      void* h, int64_t inter, int64_t rows, const char* what) {
  const std::string w = what;
  MOK_REQUIRE(inter < (int64_t(1) << 30), w + ".inter", "2*inter below 2^31, got inter = ", inter);
  // The epilogue's 4-byte gu loads (d_gu goes through a TMA map, which checks its own alignment).
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(gu) % 16 == 0, w + ".gu", "16-byte aligned");
  // In place is safe only exactly: each tile overwrites the gu elements it read, nothing else.
  const auto gu_lo = reinterpret_cast<uintptr_t>(gu), out_lo = reinterpret_cast<uintptr_t>(d_gu);
  const auto span = static_cast<uintptr_t>(rows * 2 * inter * 2);
  MOK_REQUIRE(gu_lo == out_lo || gu_lo + span <= out_lo || out_lo + span <= gu_lo, w + ".d_gu",
              "either gu itself (in place) or a buffer that does not overlap gu");
  MOK_REQUIRE((row_weight == nullptr) == (router_partial == nullptr) && (row_weight == nullptr) == (h == nullptr),
              w + ".row_weight",
              "row_weight, router_partial and h come together (unweighted rows, the router-weight gradient)");
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(h) % 4 == 0, w + ".h", "4-byte aligned");
  p.params.gu = gu;
  p.params.row_weight = row_weight;
  p.params.router_partial = router_partial;
  p.params.fc1_h = h;
  p.params.router_parts = static_cast<int32_t>(router_parts(inter));
}

namespace {
// The rows a GEMM's idle producer warps copy beside it (RowPull), checked by name ("<what>.pull").
void set_row_pull(Plan& p, const RowPull& g, const char* what) {
  if (g.to == nullptr) return;
  const std::string w = std::string(what) + ".pull";
  MOK_REQUIRE(g.src_rank && g.src_slot && g.total_rows && g.from, w,
              "src_rank, src_slot, total_rows and from must be given with `to`");
  MOK_REQUIRE(g.n > 0 && g.n % 8 == 0 && g.n < (int64_t(1) << 31), w + ".n",
              "a positive multiple of 8 below 2^31, got ", g.n);
  MOK_REQUIRE(g.top_k >= 1 && g.top_k < (int64_t(1) << 31), w + ".top_k", "in [1, 2^31), got ", g.top_k);
  MOK_REQUIRE(g.row_begin >= 0 && (g.row_end < 0 || g.row_end >= g.row_begin), w + ".row_begin",
              "need 0 <= row_begin, and row_begin <= row_end unless row_end < 0 (to the rows' end), got ",
              g.row_begin, ", ", g.row_end);
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(g.to) % 16 == 0, w + ".to", "16-byte aligned");
  MOK_REQUIRE(p.grid > 0, w, "needs a launch: the call has no tiles");
  p.params.pull_rank = g.src_rank;
  p.params.pull_slot = g.src_slot;
  p.params.pull_total = g.total_rows;
  p.params.pull_from = g.from;
  p.params.pull_to = g.to;
  p.params.pull_abort = g.abort;
  p.params.pull_row_begin = g.row_begin;
  p.params.pull_row_end = g.row_end;
  p.params.pull_vecs = static_cast<int32_t>(g.n / 8);
  p.params.pull_top_k = static_cast<int32_t>(g.top_k);
}
}  // namespace

Plan plan_dgrad_swiglu(const DgradSwiGLUArgs& a, const Options& o) {
  MOK_REQUIRE(a.dy && a.w_down && a.gu && a.d_gu, "dgrad_swiglu", "dy, w_down, gu and d_gu must be given");
  MOK_REQUIRE(a.inter % kGateUpGroup == 0, "dgrad_swiglu.inter", "multiple of ", kGateUpGroup,
              " (gate/up order), got ", a.inter);
  const int64_t rows = a.num_m_tiles * kBlockM;
  Plan p = m_grouped_plan(Form::DgradSwiGLU, a.hidden, a.inter, a.experts, a.tile_expert, a.num_m_tiles, o,
                          "dgrad_swiglu");
  set_dgrad_swiglu(p, a.gu, a.d_gu, a.row_weight, a.router_partial, a.h, a.inter, rows, "dgrad_swiglu");
  set_row_pull(p, a.pull, "dgrad_swiglu");
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(rows);
  p.map_a = make_map_2d(a.dy, u, uint64_t(a.hidden), 128);
  p.map_b = make_map_3d(a.w_down, uint64_t(a.experts), uint64_t(a.hidden), uint64_t(a.inter), 64);  // {n, k, e}
  p.map_b_half = p.map_b;
  p.map_d0 = make_map_2d(a.d_gu, u, uint64_t(2 * a.inter), 64);
  p.map_d1 = p.map_d0;
  return p;
}

Plan plan_fp8_dgrad_swiglu(const Fp8DgradSwiGLUArgs& a, const Options& o) {
  MOK_REQUIRE(a.dy && a.dy_scales && a.w_down_t && a.w_down_t_scales && a.gu && a.d_gu, "fp8_dgrad_swiglu",
              "dy, w_down_t, their scales, gu and d_gu must be given");
  MOK_REQUIRE(a.hidden > 0 && a.hidden % 128 == 0, "fp8_dgrad_swiglu.hidden", "a positive multiple of 128, got ",
              a.hidden);
  MOK_REQUIRE(a.inter > 0 && a.inter % 128 == 0, "fp8_dgrad_swiglu.inter", "a positive multiple of 128, got ",
              a.inter);
  MOK_REQUIRE(!o.cluster, "options.cluster", "not with FP8 (2-CTA clusters are BF16 only so far)");
  MOK_REQUIRE(o.block_n == 0 || o.block_n == 256, "options.block_n",
              "0 or 256 for FP8's dgrad + SwiGLU (the epilogue's packed chunks), got ", o.block_n);
  Options o256 = o;
  o256.block_n = 256;
  const int64_t rows = a.num_m_tiles * kBlockM;
  Plan p = m_grouped_plan(Form::Fp8DgradSwiGLU, a.hidden, a.inter, a.experts, a.tile_expert, a.num_m_tiles, o256,
                          "fp8_dgrad_swiglu");
  set_dgrad_swiglu(p, a.gu, a.d_gu, a.row_weight, a.router_partial, a.h, a.inter, rows, "fp8_dgrad_swiglu");
  p.params.k_blocks = static_cast<int32_t>(a.hidden / 128);
  p.params.scale_a = a.dy_scales;
  p.params.scale_b = a.w_down_t_scales;
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(rows);
  p.map_a = make_map_2d(a.dy, u, uint64_t(a.hidden), 128, MapType::E4M3);
  p.map_b = make_map_3d(a.w_down_t, uint64_t(a.experts), uint64_t(a.inter), uint64_t(a.hidden), 256, MapType::E4M3);
  p.map_b_half = p.map_b;
  p.map_d0 = make_map_2d(a.d_gu, u, uint64_t(2 * a.inter), 64);
  p.map_d1 = p.map_d0;
  return p;
}

// What every K-grouped plan (the weight gradients, both precisions) shares: the tiles of m x n per
// expert over the experts' rows, grid and FLOPs. The caller adds its operands and outputs.
Plan k_grouped_plan(Form form, int64_t m, int64_t n, int64_t experts, int64_t rows_total, const int32_t* row_begin,
                    const int32_t* rows, const int32_t* range, const Options& o) {
  Plan p;
  p.form = form;
  p.params.num_m_tiles = static_cast<int32_t>(cdiv(m, kBlockM));
  pick_block_n(p, o, experts * p.params.num_m_tiles, n);
  p.params.n = static_cast<int32_t>(n);
  p.params.m_out = static_cast<int32_t>(m);
  p.params.experts = static_cast<int32_t>(experts);
  p.params.expert_row_begin = row_begin;
  p.params.expert_rows = rows;
  p.params.expert_range = range;
  fill_common(p, o, experts * p.params.num_m_tiles * p.params.n_tiles,
              experts * cdiv(p.params.num_m_tiles, 2) * p.params.n_tiles);
  p.padded_flops = 2.0 * double(rows_total) * double(m) * double(n);
  return p;
}

// The weight gradients' outputs (both precisions): dw [experts, m, n], or with dw_up the packed
// gate/up rows split into the gate rows (dw) and the up rows (dw_up), each [experts, m / 2, n],
// in 32-row boxes (one warpgroup's 64 packed rows = 32 of each).
void set_wgrad_outputs(Plan& p, void* dw, void* dw_up, int64_t experts, int64_t m, int64_t n,
                       MapType type = MapType::BF16) {
  if (dw_up == nullptr) {
    p.map_d0 = make_map_3d(dw, uint64_t(experts), uint64_t(m), uint64_t(n), 64, type);
    p.map_d1 = p.map_d0;
  } else {
    p.map_d0 = make_map_3d(dw, uint64_t(experts), uint64_t(m / 2), uint64_t(n), 32, type);
    p.map_d1 = make_map_3d(dw_up, uint64_t(experts), uint64_t(m / 2), uint64_t(n), 32, type);
    p.params.split_gate_up = 1;
  }
}

// The weight gradients' carry across calls (both precisions: WgradArgs, Fp8WgradArgs).
void set_wgrad_carry(Plan& p, const float* in, float* out, const int32_t* experts, const int32_t* rows_total,
                     int64_t m, int64_t n, const char* what) {
  const bool carry = in != nullptr;
  MOK_REQUIRE(carry == (out != nullptr) && carry == (experts != nullptr), mok::detail::concat(what, ".carry"),
              "carry_in, carry_out and carry_experts must be given together (or none)");
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0,
              mok::detail::concat(what, ".carry"), "16-byte aligned (float4 accesses)");
  const auto carry_bytes = static_cast<uintptr_t>(wgrad_carry_floats(m, n) * 4);
  const auto in_lo = reinterpret_cast<uintptr_t>(in), out_lo = reinterpret_cast<uintptr_t>(out);
  MOK_REQUIRE(!carry || in_lo + carry_bytes <= out_lo || out_lo + carry_bytes <= in_lo,
              mok::detail::concat(what, ".carry_out"), "must not overlap carry_in (the two are read and written in the same call)");
  p.params.carry_in = in;
  p.params.carry_out = out;
  p.params.carry_experts = experts;
  p.params.expert_rows_total = rows_total;
}

Plan plan_wgrad(const WgradArgs& a, const Options& o) {
  require_dims(a.m, a.n, "wgrad");
  MOK_REQUIRE(a.experts >= 1, "wgrad.experts", ">= 1, got ", a.experts);
  MOK_REQUIRE(a.rows_total >= 1 && a.rows_total < (int64_t(1) << 31), "wgrad.rows_total",
              "1 <= rows_total < 2^31, got ", a.rows_total);
  MOK_REQUIRE(a.a && a.b && a.dw && a.expert_row_begin && a.expert_rows, "wgrad",
              "a, b, dw, expert_row_begin and expert_rows must be given");
  MOK_REQUIRE(a.dw_up == nullptr || a.m % (2 * kGateUpGroup) == 0, "wgrad.m",
              "a multiple of 64 (whole groups of 32 gate and 32 up rows) with dw_up, got ", a.m);
  Plan p = k_grouped_plan(Form::Wgrad, a.m, a.n, a.experts, a.rows_total, a.expert_row_begin, a.expert_rows,
                          a.expert_range, o);
  // The bf16 kernel's tile decode divides by float reciprocals, exact below 2^22 (schedule_math.h).
  const int64_t tiles = a.experts * p.params.num_m_tiles * p.params.n_tiles;
  MOK_REQUIRE(tiles < (int64_t(1) << 22), "wgrad",
              "fewer than 2^22 output tiles (the tile decode's exact division), got ", a.experts, " experts x ", p.params.num_m_tiles, " M tiles x ", p.params.n_tiles, " N tiles of ",
              p.block_n, " = ", tiles);
  set_wgrad_carry(p, a.carry_in, a.carry_out, a.carry_experts, a.expert_rows_total, a.m, a.n, "wgrad");
  const bool hold = a.hold_a != nullptr;
  MOK_REQUIRE(hold == (a.hold_b != nullptr), "wgrad.hold", "hold_a and hold_b must be given together (or none)");
  MOK_REQUIRE(!hold || !o.cluster, "options.cluster", "not with wgrad.hold_* (its kernel runs without clusters)");
  MOK_REQUIRE(!hold || (a.hold_a_row >= kBlockM && a.hold_a_row <= a.hold_a_rows && a.hold_b_row >= kBlockM &&
                        a.hold_b_row <= a.hold_b_rows && a.hold_a_rows < (int64_t(1) << 31) &&
                        a.hold_b_rows < (int64_t(1) << 31)),
              "wgrad.hold", "hold_a_row / hold_b_row in [128, the hold buffer's rows] (rows < 2^31), got ",
              a.hold_a_row, " of ", a.hold_a_rows, " and ", a.hold_b_row, " of ", a.hold_b_rows);
  MOK_REQUIRE(!hold || a.hold_a_row % kBlockM == 0, "wgrad.hold_a_row", "a multiple of 128, got ", a.hold_a_row);
  MOK_REQUIRE(!hold || a.hold_b_row % kBlockM == 0, "wgrad.hold_b_row", "a multiple of 128, got ", a.hold_b_row);
  p.params.hold = hold ? 1 : 0;
  p.params.hold_a_row = static_cast<int32_t>(a.hold_a_row);
  p.params.hold_b_row = static_cast<int32_t>(a.hold_b_row);
  if (a.accumulate) {  // (refused alike whether or not this call has tiles)
    MOK_REQUIRE(!o.cluster, "options.cluster", "not with wgrad.accumulate (its kernel runs without clusters)");
    MOK_REQUIRE(reinterpret_cast<uintptr_t>(a.dw) % 16 == 0 && reinterpret_cast<uintptr_t>(a.dw_up) % 16 == 0,
                "wgrad.dw", "16-byte aligned fp32 with accumulate");
    p.params.wgrad_accumulate = 1;
  }
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(a.rows_total);
  p.map_a = make_map_2d(a.a, u, uint64_t(a.m), 64);                 // {m, rows}: MN-major A
  p.map_b = make_map_3d(a.b, 1, u, uint64_t(a.n), 64);              // {n, rows, 1}: MN-major B
  p.map_b_half = p.map_b;
  if (a.hold_a != nullptr) {  // (the same boxes over the hold buffers)
    p.map_a_hold = make_map_2d(a.hold_a, uint64_t(a.hold_a_rows), uint64_t(a.m), 64);
    p.map_b_hold = make_map_3d(a.hold_b, 1, uint64_t(a.hold_b_rows), uint64_t(a.n), 64);
  }
  // With accumulate the maps are fp32 (the epilogue reduce-adds into them).
  set_wgrad_outputs(p, a.dw, a.dw_up, a.experts, a.m, a.n, a.accumulate ? MapType::F32Tile : MapType::BF16);
  return p;
}

namespace {
Plan fp8_grouped_plan(const Fp8GroupedArgs& a, const RowScatter* sc, const Options& o) {
  MOK_REQUIRE(a.a && a.a_scales && a.w && a.w_scales && (a.y || sc), "fp8_grouped",
              "a, a_scales, w, w_scales and y (unless scattered) must be given");
  MOK_REQUIRE(a.k > 0 && a.k % 128 == 0, "fp8_grouped.k", "a positive multiple of 128 (one scale block per 128 of K), got ",
              a.k);
  MOK_REQUIRE(a.n > 0 && a.n % 128 == 0, "fp8_grouped.n", "a positive multiple of 128 (the weights' 128 x 128 scale blocks), got ",
              a.n);
  MOK_REQUIRE(!o.cluster, "options.cluster", "not with FP8 (2-CTA clusters are BF16 only so far)");
  Plan p = m_grouped_plan(Form::Fp8Plain, a.k, a.n, a.experts, a.tile_expert, a.num_m_tiles, o, "fp8_grouped");
  if (sc != nullptr) set_scatter(p, *sc, "fp8_grouped_scatter");
  p.params.k_blocks = static_cast<int32_t>(a.k / 128);  // FP8 stages hold 128 K elements
  p.params.scale_a = a.a_scales;
  p.params.scale_b = a.w_scales;
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(a.num_m_tiles * kBlockM);
  p.map_a = make_map_2d(a.a, u, uint64_t(a.k), 128, MapType::E4M3);
  p.map_b = make_map_3d(a.w, uint64_t(a.experts), uint64_t(a.n), uint64_t(a.k), uint32_t(p.block_n), MapType::E4M3);
  p.map_b_half = p.map_b;
  p.map_d0 = sc == nullptr ? make_map_2d(a.y, u, uint64_t(a.n), 64) : p.map_a;  // (prefetched: a valid map)
  p.map_d1 = p.map_d0;
  return p;
}
}  // namespace

Plan plan_fp8_grouped(const Fp8GroupedArgs& a, const Options& o) { return fp8_grouped_plan(a, nullptr, o); }
Plan plan_fp8_grouped_scatter(const Fp8GroupedArgs& a, const RowScatter& to, const Options& o) {
  return fp8_grouped_plan(a, &to, o);
}

Plan plan_fp8_fc1(const Fp8Fc1Args& a, const Options& o) {
  MOK_REQUIRE(a.x && a.x_scales && a.w_gate && a.w_gate_scales && a.w_up && a.w_up_scales && a.h && a.h_scales,
              "fp8_fc1", "x, w_gate, w_up, h and their scales must be given");
  MOK_REQUIRE(a.hidden > 0 && a.hidden % 128 == 0, "fp8_fc1.hidden", "a positive multiple of 128, got ", a.hidden);
  MOK_REQUIRE(a.inter > 0 && a.inter % 128 == 0, "fp8_fc1.inter",
              "a positive multiple of 128 (h's 1 x 128 blocks are whole tiles), got ", a.inter);
  MOK_REQUIRE(!o.cluster, "options.cluster", "not with FP8 (2-CTA clusters are BF16 only so far)");
  MOK_REQUIRE(o.block_n == 0 || o.block_n == 256, "options.block_n",
              "0 or 256 for FP8's FC1 (a tile holds one 1 x 128 block of h per row), got ", o.block_n);
  Options o256 = o;
  o256.block_n = 256;
  Plan p = m_grouped_plan(Form::Fp8Fc1, a.hidden, 2 * a.inter, a.experts, a.tile_expert, a.num_m_tiles, o256,
                          "fp8_fc1");
  p.params.k_blocks = static_cast<int32_t>(a.hidden / 128);
  p.params.scale_a = a.x_scales;
  p.params.scale_b = a.w_gate_scales;
  p.params.scale_b_up = a.w_up_scales;
  p.params.scale_h = a.h_scales;
  p.params.h_mx = a.h_mx ? 1 : 0;
  p.params.fc1_h = a.h;
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(a.gu) % 4 == 0, "fp8_fc1.gu", "4-byte aligned (bf16 pairs are stored)");
  p.params.fc1_gu = a.gu;
  p.params.b_gate_up = 1;
  p.params.store_gu = 0;  // (the bf16 FC1's map store; FP8's gate/up rows go through fc1_gu)
  if (p.grid == 0) return p;
  const auto u = static_cast<uint64_t>(a.num_m_tiles * kBlockM);
  const auto box = static_cast<uint32_t>(kGateUpGroup);  // 32-row boxes, alternately gate and up
  p.map_a = make_map_2d(a.x, u, uint64_t(a.hidden), 128, MapType::E4M3);
  p.map_b = make_map_3d(a.w_gate, uint64_t(a.experts), uint64_t(a.inter), uint64_t(a.hidden), box, MapType::E4M3);
  p.map_b_half = make_map_3d(a.w_up, uint64_t(a.experts), uint64_t(a.inter), uint64_t(a.hidden), box, MapType::E4M3);
  p.map_d0 = p.map_a;  // (no map output: h is stored directly)
  p.map_d1 = p.map_a;
  return p;
}

Plan plan_fp8_wgrad(const Fp8WgradArgs& a, const Options& o) {
  MOK_REQUIRE(a.a_t && a.a_scales && a.b_t && a.b_scales && a.dw && a.expert_row_begin && a.expert_rows, "fp8_wgrad",
              "a_t, b_t, their scales, dw, expert_row_begin and expert_rows must be given");
  MOK_REQUIRE(a.m_out > 0 && a.m_out % 128 == 0 && a.m_out < (int64_t(1) << 31), "fp8_wgrad.m_out",
              "a positive multiple of 128 (whole 128 x 1 scale rows per output tile), got ", a.m_out);
  MOK_REQUIRE(a.n > 0 && a.n % 128 == 0 && a.n < (int64_t(1) << 31), "fp8_wgrad.n",
              "a positive multiple of 128, got ", a.n);
  MOK_REQUIRE(a.experts >= 1, "fp8_wgrad.experts", ">= 1, got ", a.experts);
  MOK_REQUIRE(a.rows_total >= 1 && a.rows_total < (int64_t(1) << 31) - 128, "fp8_wgrad.rows_total",
              "1 <= rows_total < 2^31 - 128, got ", a.rows_total);
  MOK_REQUIRE(reinterpret_cast<uintptr_t>(a.a_scales) % 16 == 0 && reinterpret_cast<uintptr_t>(a.b_scales) % 16 == 0,
              "fp8_wgrad.a_scales, b_scales", "16-byte aligned (the stages' scales are TMA loads)");
  MOK_REQUIRE(!o.cluster, "options.cluster", "not with FP8 (2-CTA clusters are BF16 only so far)");
  // (The stages carry the tile's scales, engine_fp8.cuh: 5 stages at 128 wide, 3 at 256.)
  Plan p = k_grouped_plan(Form::Fp8Wgrad, a.m_out, a.n, a.experts, a.rows_total, a.expert_row_begin,
                          a.expert_rows, a.expert_range, o);
  set_wgrad_carry(p, a.carry_in, a.carry_out, a.carry_experts, a.expert_rows_total, a.m_out, a.n, "fp8_wgrad");
  if (p.grid == 0) return p;
  const auto ld = static_cast<uint64_t>(cdiv(a.rows_total, 128) * 128);
  p.map_a = make_map_2d(a.a_t, uint64_t(a.m_out), ld, 128, MapType::E4M3);                       // {rows, m_out}
  p.map_b = make_map_3d(a.b_t, 1, uint64_t(a.n), ld, uint32_t(p.block_n), MapType::E4M3);  // {rows, n, 1}
  p.map_b_half = p.map_b;
  p.map_sa = make_map_rows_f32(a.a_scales, ld / 128, uint64_t(a.m_out), 128);                // {m_out, ld / 128}
  p.map_sb = make_map_rows_f32(a.b_scales, ld / 128, uint64_t(a.n), uint32_t(p.block_n));  // {n, ld / 128}
  set_wgrad_outputs(p, a.dw, a.dw_up, a.experts, a.m_out, a.n);
  return p;
}

void run(const Plan& plan, cudaStream_t stream) {
  switch (plan.form) {
    case Form::Fc1SwiGLU: detail::launch_fc1(plan, stream); break;
    case Form::Plain: detail::launch_plain(plan, stream); break;
    case Form::Dgrad: detail::launch_dgrad(plan, stream); break;
    case Form::DgradScatter: detail::launch_dgrad_scatter(plan, stream); break;
    case Form::DgradSwiGLU: detail::launch_dgrad_swiglu(plan, stream); break;
    case Form::Wgrad: detail::launch_wgrad(plan, stream); break;
    case Form::Fp8Plain:
    case Form::Fp8Fc1:
    case Form::Fp8Wgrad:
    case Form::Fp8DgradSwiGLU: detail::launch_fp8_grouped(plan, stream); break;
  }
}

void pack_gate_up_host(const uint16_t* w_gate, const uint16_t* w_up, uint16_t* w1p, int64_t experts,
                       int64_t inter, int64_t hidden) {
  MOK_REQUIRE(inter % kGateUpGroup == 0, "pack_gate_up.inter", "multiple of ", kGateUpGroup, ", got ", inter);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t i = 0; i < inter; ++i) {
      const uint16_t* g = w_gate + (e * inter + i) * hidden;
      const uint16_t* u = w_up + (e * inter + i) * hidden;
      std::copy(g, g + hidden, w1p + (e * 2 * inter + packed_gate_row(i)) * hidden);
      std::copy(u, u + hidden, w1p + (e * 2 * inter + packed_up_row(i)) * hidden);
    }
  }
}

}  // namespace mok::gemm
