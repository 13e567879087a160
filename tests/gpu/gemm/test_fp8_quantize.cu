// The GPU's FP8 quantization (src/gemm/fp8_quantize.h) against the CPU spec (src/reference/
// fp8_quant.h): every E4M3 code and every scale the same bits, for 1 x 128 and 128 x 128 blocks with
// both scale rules and for MXFP8, on matrices whose edges cut blocks, over > 10^6 values with the
// edge cases planted each in its own block (all zeros, a NaN, an Inf, a block of nothing but
// fp32-subnormal magnitudes, the top of the range, exact multiples of 448, negative zeros).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gemm/fp8_cvt.cuh"
#include "gemm/fp8_quantize.h"
#include "gemm_test_util.h"
#include "gpu_test_util.h"
#include "mok/bf16.hpp"
#include "mok/errors.hpp"
#include "reference/fp8_quant.h"

namespace {

using mok::test::bits_of;
using mok::test::count_diff;
using mok::test::DevBuf;
using mok::test::download;
using mok::test::random_bf16;
using mok::test::upload;
namespace fp8 = mok::fp8;

struct Shape {
  int64_t rows, cols;
};

// Random values with the edge cases planted, each in its own column block of 128 (so each lands
// in its own 1 x 128, 128 x 128 and MX block): block 0 all zeros (rows 0-127), block 1 a NaN (row
// 1), block 2 a -Inf (row 2), block 3 nothing but fp32-subnormal bf16 magnitudes (rows 0-127: a
// whole subnormal block of either shape, so the scale floors are reached), block 4 the largest
// finite bf16 values (row 4), block 5 exact multiples of 448 (row 5), block 6 negative zeros (row
// 6) — where the matrix has those rows and columns (the 1024 x 1100, 257 x 1000 and 300 x 1040 cases have all).
std::vector<uint16_t> matrix(const Shape& s, uint64_t seed) {
  std::vector<uint16_t> v = random_bf16(size_t(s.rows * s.cols), seed, 3.0);
  const auto plant = [&](int64_t r, int64_t c, uint16_t b) {
    if (r < s.rows && c < s.cols) v[size_t(r * s.cols + c)] = b;
  };
  for (int64_t r = 0; r < 128; ++r)
    for (int64_t c = 0; c < 128; ++c) {
      plant(r, c, 0);                                       // block 0: zeros
      plant(r, 3 * 128 + c, uint16_t(0x0001 + (r * 128 + c) % 127));  // block 3: subnormal magnitudes
    }
  plant(1, 128 + 5, 0x7fc0);  // block 1: NaN
  plant(2, 256 + 70, 0xff80);  // block 2: -Inf
  plant(4, 512 + 1, 0x7f7f);   // block 4: the largest finite bf16 (~3.39e38), both signs
  plant(4, 512 + 2, 0xff7f);
  for (int64_t c = 0; c < 32; ++c) plant(5, 640 + c, bits_of(448.0f * float(c - 16)));  // block 5
  for (int64_t c = 0; c < 64; ++c) plant(6, 768 + c, 0x8000);                           // block 6: -0
  return v;
}

// (300 x 1040: cols a multiple of 16 whose last 1 x 128 block is cut, for the 16-byte path.)
const Shape kShapes[] = {{1024, 1100}, {257, 1000}, {300, 1040}, {128, 128}, {3, 4133}, {300, 129}, {1, 1}};

// Every fp32 bit pattern through the instruction (gemm::e4m3x2, both byte positions) and through
// the spec's integer encode: the count of disagreements and the first one.
__global__ void cvt_vs_spec_kernel(unsigned long long* mismatches, unsigned* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    const float v = __uint_as_float(uint32_t(i)), w = __uint_as_float(~uint32_t(i));
    const uint16_t hw = mok::gemm::e4m3x2(v, w);
    const uint16_t sw = uint16_t(fp8::e4m3_encode(v) | (uint16_t(fp8::e4m3_encode(w)) << 8));
    if (hw != sw) {
      ++bad;
      atomicMin(first, uint32_t(i));
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// Runs a (mismatch count, first mismatching index) kernel over `blocks` CTAs of 256 threads.
std::pair<unsigned long long, unsigned> count_disagreements(void (*kernel)(unsigned long long*, unsigned*),
                                                            int blocks) {
  DevBuf count(8), first(4);
  EXPECT_EQ(cudaMemset(count.p, 0, 8), cudaSuccess);
  EXPECT_EQ(cudaMemset(first.p, 0xff, 4), cudaSuccess);
  kernel<<<blocks, 256>>>(count.as<unsigned long long>(), first.as<unsigned>());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {download<unsigned long long>(count, 1)[0], download<unsigned>(first, 1)[0]};
}

TEST(Fp8Cvt, HardwareConversionIsTheSpec) {
  MOK_REQUIRE_GPUS(1);
  const auto [n, f] = count_disagreements(cvt_vs_spec_kernel, 132 * 16);
  EXPECT_EQ(n, 0ull) << "cvt.rn.satfinite.e4m3x2.f32 differs from fp8::e4m3_encode, first at fp32 bits 0x" << std::hex
                     << f;
  std::printf("[fp8 cvt] all 2^32 fp32 inputs, in both bytes: %llu disagreements\n", n);
}

// The re-blocking shift by conversions (gemm::e4m3x2_shifted): every pair of E4M3 codes (2^16)
// moved by every power of two 2^d, d = 0 .. -160, against the spec's e4m3_encode(e4m3_decode(q) 2^d)
// per byte (NaN codes excepted: the quantizers never shift one, a NaN block's codes are NaN).
__global__ void shift_vs_spec_kernel(unsigned long long* mismatches, unsigned* first) {
  unsigned long long bad = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (1u << 16) * 161u; i += gridDim.x * blockDim.x) {
    const uint16_t codes = uint16_t(i & 0xffffu);
    const int d = -int(i >> 16);
    if (fp8::e4m3_is_nan(uint8_t(codes)) || fp8::e4m3_is_nan(uint8_t(codes >> 8))) continue;
    const float f = d >= -149 ? fp8::detail::pow2(d) : 0.0f;
    const uint16_t hw = mok::gemm::e4m3x2_shifted(codes, f);
    const uint16_t sw = uint16_t(fp8::e4m3_encode(fp8::e4m3_decode(uint8_t(codes)) * f) |
                                 (uint16_t(fp8::e4m3_encode(fp8::e4m3_decode(uint8_t(codes >> 8)) * f)) << 8));
    if (hw != sw) {
      ++bad;
      atomicMin(first, i);
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

TEST(Fp8Cvt, ShiftByConversionsIsTheSpec) {
  MOK_REQUIRE_GPUS(1);
  const auto [n, f] = count_disagreements(shift_vs_spec_kernel, 132 * 8);
  EXPECT_EQ(n, 0ull) << "e4m3x2_shifted differs from the spec, first at codes 0x" << std::hex << (f & 0xffffu)
                     << std::dec << ", d = -" << (f >> 16);
  std::printf("[fp8 cvt] every code pair shifted by 2^0 .. 2^-160: %llu disagreements\n", n);
}

TEST(Fp8Quantize, BlockScaledMatchesTheSpecBitForBit) {
  MOK_REQUIRE_GPUS(1);
  int64_t values = 0;
  for (const Shape& s : kShapes)
    for (const int block_rows : {1, 128})
      for (const fp8::ScaleRule rule : {fp8::ScaleRule::Fp32, fp8::ScaleRule::Pow2}) {
        SCOPED_TRACE(testing::Message() << s.rows << " x " << s.cols << ", blocks of " << block_rows
                                        << " x 128, rule " << (rule == fp8::ScaleRule::Fp32 ? "fp32" : "pow2"));
        const std::vector<uint16_t> x = matrix(s, 7 + uint64_t(s.cols));
        const fp8::BlockShape block{block_rows, fp8::kBlock};
        const size_t n = x.size(), ns = size_t(fp8::scale_count(s.rows, s.cols, block));
        std::vector<uint8_t> want_q(n);
        std::vector<float> want_s(ns);
        fp8::quantize_blocked(reinterpret_cast<const mok::bf16*>(x.data()), s.rows, s.cols, block, rule,
                              want_q.data(), want_s.data());
        DevBuf dx(n * 2), dq(n), ds(ns * 4);
        upload(dx, x);
        mok::gemm::quantize_fp8_blocked(dx.p, s.rows, s.cols, block_rows, rule, dq.p, ds.as<float>(), nullptr);
        ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
        EXPECT_EQ(count_diff(download<uint8_t>(dq, n), want_q), 0) << "codes differ";
        EXPECT_EQ(count_diff(download<float>(ds, ns), want_s), 0) << "scales differ";
        values += int64_t(n);
      }
  std::printf("[fp8 quantize] block-scaled: %lld values compared with the spec\n", (long long)values);
  EXPECT_GE(values, 1000000);
}

// The FP8 backward's weight-gradient operands: 128 x 1 blocks (one per 128 rows of a column, the
// M tiles), codes transposed to K-major [cols, rows rounded up to 128] with zero codes past the
// last row; against the spec's row-major codes and scales (BlockShape{128, 1}, fp32 scales).
TEST(Fp8Quantize, TokenBlocksTransposedMatchTheSpecBitForBit) {
  MOK_REQUIRE_GPUS(1);
  int64_t values = 0;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.rows << " x " << s.cols);
    const std::vector<uint16_t> x = matrix(s, 11 + uint64_t(s.rows));
    const fp8::BlockShape block{fp8::kBlock, 1};
    const size_t n = x.size(), ns = size_t(fp8::scale_count(s.rows, s.cols, block));
    std::vector<uint8_t> want_q(n);
    std::vector<float> want_s(ns);
    fp8::quantize_blocked(reinterpret_cast<const mok::bf16*>(x.data()), s.rows, s.cols, block, fp8::ScaleRule::Fp32,
                          want_q.data(), want_s.data());
    const int64_t ld = (s.rows + fp8::kBlock - 1) / fp8::kBlock * fp8::kBlock;
    DevBuf dx(n * 2), dq(size_t(s.cols * ld)), ds(ns * 4);
    upload(dx, x);
    MOK_ASSERT_CUDA(cudaMemset(dq.p, 0xAB, size_t(s.cols * ld)));  // the padding must be written
    mok::gemm::quantize_fp8_token_blocks_t(dx.p, s.rows, s.cols, dq.p, ds.as<float>(), nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    const auto got_q = download<uint8_t>(dq, size_t(s.cols * ld));
    int64_t bad = 0, bad_pad = 0;
    for (int64_t c = 0; c < s.cols; ++c)
      for (int64_t r = 0; r < ld; ++r) {
        const uint8_t g = got_q[size_t(c * ld + r)];
        if (r < s.rows)
          bad += g != want_q[size_t(r * s.cols + c)];
        else
          bad_pad += g != 0;
      }
    EXPECT_EQ(bad, 0) << "codes differ";
    EXPECT_EQ(bad_pad, 0) << "padding rows are not zero codes";
    EXPECT_EQ(count_diff(download<float>(ds, ns), want_s), 0) << "scales differ";
    values += int64_t(n);
  }
  std::printf("[fp8 quantize] 128 x 1 token blocks, transposed: %lld values compared with the spec\n",
              (long long)values);
  EXPECT_GE(values, 1000000);
}

// The quantizers load pairs or quads of bf16 and store runs of codes when the buffers allow it,
// and fall back to single elements when they do not: buffers offset from their allocation (the
// input by 1 and 2 elements, the codes by 1 and 4 bytes) give the spec's bits as well.
TEST(Fp8Quantize, UnalignedBuffersGiveTheSameBits) {
  MOK_REQUIRE_GPUS(1);
  const Shape s{300, 1024};
  const std::vector<uint16_t> x = matrix(s, 23);
  const size_t n = x.size();
  const int64_t ld = (s.rows + fp8::kBlock - 1) / fp8::kBlock * fp8::kBlock;
  const fp8::BlockShape rows_block{1, fp8::kBlock}, token_block{fp8::kBlock, 1};
  std::vector<uint8_t> want_rq(n), want_tq(n);
  std::vector<float> want_rs(size_t(fp8::scale_count(s.rows, s.cols, rows_block)));
  std::vector<float> want_ts(size_t(fp8::scale_count(s.rows, s.cols, token_block)));
  fp8::quantize_blocked(reinterpret_cast<const mok::bf16*>(x.data()), s.rows, s.cols, rows_block, fp8::ScaleRule::Fp32,
                        want_rq.data(), want_rs.data());
  fp8::quantize_blocked(reinterpret_cast<const mok::bf16*>(x.data()), s.rows, s.cols, token_block,
                        fp8::ScaleRule::Fp32, want_tq.data(), want_ts.data());
  for (const auto& [in_off, q_off] : {std::pair<int, int>{1, 1}, std::pair<int, int>{2, 4}}) {
    SCOPED_TRACE(testing::Message() << "input +" << in_off << " elements, codes +" << q_off << " bytes");
    DevBuf dx((n + 8) * 2), dq(size_t(s.cols * ld) + 16), ds(want_ts.size() * 4);
    MOK_ASSERT_CUDA(cudaMemset(dq.p, 0xAB, dq.bytes));  // (the bytes before q are downloaded too: initcheck)
    const std::vector<uint16_t> pad(size_t(in_off), 0);
    std::vector<uint16_t> shifted(pad);
    shifted.insert(shifted.end(), x.begin(), x.end());
    upload(dx, shifted);
    const void* in = static_cast<const uint16_t*>(dx.p) + in_off;
    void* q = static_cast<uint8_t*>(dq.p) + q_off;
    mok::gemm::quantize_fp8_blocked(in, s.rows, s.cols, 1, fp8::ScaleRule::Fp32, q, ds.as<float>(), nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    std::vector<uint8_t> got = download<uint8_t>(dq, n + size_t(q_off));
    EXPECT_EQ(count_diff(std::vector<uint8_t>(got.begin() + q_off, got.end()), want_rq), 0) << "1 x 128 codes differ";
    EXPECT_EQ(count_diff(download<float>(ds, want_rs.size()), want_rs), 0) << "1 x 128 scales differ";
    MOK_ASSERT_CUDA(cudaMemset(dq.p, 0xAB, dq.bytes));  // the padding rows must be written
    mok::gemm::quantize_fp8_token_blocks_t(in, s.rows, s.cols, q, ds.as<float>(), nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    got = download<uint8_t>(dq, size_t(s.cols * ld) + size_t(q_off));
    int64_t bad = 0;
    for (int64_t c = 0; c < s.cols; ++c)
      for (int64_t r = 0; r < ld; ++r) {
        const uint8_t g = got[size_t(q_off + c * ld + r)];
        bad += r < s.rows ? g != want_tq[size_t(r * s.cols + c)] : g != 0;
      }
    EXPECT_EQ(bad, 0) << "128 x 1 transposed codes differ";
    EXPECT_EQ(count_diff(download<float>(ds, want_ts.size()), want_ts), 0) << "128 x 1 scales differ";
  }
}

// A routed layout of 640 rows in 128-row tiles (the FP8 backward's): expert 0 rows [0, 200) in
// tiles 0-1, expert 1 empty, expert 2 rows [256, 556) in tiles 2-4; rows 200-255 and 556-639 are
// padding (filled with data below, which the token blocks must not see and the rows must keep).
struct Routed {
  static constexpr int64_t kRows = 640;
  std::vector<int32_t> tile_expert{0, 0, 2, 2, 2}, begin{0, 256, 256}, count{200, 0, 300};
  DevBuf te{5 * 4}, b{3 * 4}, n{3 * 4};
  Routed() {
    upload(te, tile_expert);
    upload(b, begin);
    upload(n, count);
  }
  mok::gemm::RoutedSegments seg() const { return {te.as<int32_t>(), b.as<int32_t>(), n.as<int32_t>(), 5}; }
  bool valid(int64_t r) const { return r < 200 || (r >= 256 && r < 556); }
};

// The FP8 backward's d_y and d_gu in one read (quantize_fp8_rows_and_token_blocks_t): the same
// bits as the 1 x 128 pass and the token-block pass (each checked against the spec above), with
// and without routed segments, both scale rules for the rows, an odd width (the two-pass path).
TEST(Fp8Quantize, RowsAndTokenBlocksInOnePassMatchTheTwoPasses) {
  MOK_REQUIRE_GPUS(1);
  const Routed routed;
  struct Case {
    Shape s;
    bool seg;
  };
  const Case cases[] = {{{1024, 1100}, false}, {{300, 1040}, false}, {{257, 1000}, false}, {{128, 128}, false},
                        {{3, 4133}, false} /* odd: the two-pass fallback */,    {{Routed::kRows, 7168}, true}, {{Routed::kRows, 1536}, true},
                        {{Routed::kRows, 130}, true}};
  int64_t values = 0;
  for (const Case& k : cases)
    for (const fp8::ScaleRule rule : {fp8::ScaleRule::Fp32, fp8::ScaleRule::Pow2}) {
      const Shape s = k.s;
      SCOPED_TRACE(testing::Message() << s.rows << " x " << s.cols << (k.seg ? ", routed segments" : "") << ", rule "
                                      << (rule == fp8::ScaleRule::Fp32 ? "fp32" : "pow2"));
      const std::vector<uint16_t> x = matrix(s, 31 + uint64_t(s.cols));
      const size_t n = x.size();
      const int64_t ld = (s.rows + fp8::kBlock - 1) / fp8::kBlock * fp8::kBlock;
      const size_t nt = size_t(s.cols * ld), nrs = size_t(s.rows * ((s.cols + 127) / 128));
      const size_t nts = size_t(ld / 128 * s.cols);
      DevBuf dx(n * 2), q1(n), rs1(nrs * 4), t1(nt), ts1(nts * 4), q2(n), rs2(nrs * 4), t2(nt), ts2(nts * 4);
      upload(dx, x);
      for (DevBuf* b : {&q1, &rs1, &t1, &ts1, &q2, &rs2, &t2, &ts2}) MOK_ASSERT_CUDA(cudaMemset(b->p, 0xAB, b->bytes));
      const mok::gemm::RoutedSegments seg = k.seg ? routed.seg() : mok::gemm::RoutedSegments{};
      mok::gemm::quantize_fp8_blocked(dx.p, s.rows, s.cols, 1, rule, q1.p, rs1.as<float>(), nullptr);
      mok::gemm::quantize_fp8_token_blocks_t(dx.p, s.rows, s.cols, t1.p, ts1.as<float>(), nullptr, seg);
      mok::gemm::quantize_fp8_rows_and_token_blocks_t(dx.p, s.rows, s.cols, rule, q2.p, rs2.as<float>(), t2.p,
                                                      ts2.as<float>(), nullptr, seg);
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      EXPECT_EQ(count_diff(download<uint8_t>(q2, n), download<uint8_t>(q1, n)), 0) << "1 x 128 codes differ";
      EXPECT_EQ(count_diff(download<float>(rs2, nrs), download<float>(rs1, nrs)), 0) << "1 x 128 scales differ";
      EXPECT_EQ(count_diff(download<uint8_t>(t2, nt), download<uint8_t>(t1, nt)), 0) << "token-block codes differ";
      EXPECT_EQ(count_diff(download<float>(ts2, nts), download<float>(ts1, nts)), 0)
          << "token-block scales differ";
      values += int64_t(n);
    }
  std::printf("[fp8 quantize] rows + token blocks in one pass: %lld values compared with the two passes\n",
              (long long)values);
}

// x's token blocks read where the rows live (quantize_fp8_token_blocks_t_gather: two "ranks" of
// 100 and 77 tokens, top-4 slots): the same bits as the token blocks of the copied rows; an
// aborted call reads no peer (zero codes).
TEST(Fp8Quantize, GatheredTokenBlocksMatchTheCopiedRows) {
  MOK_REQUIRE_GPUS(1);
  const Routed routed;
  const int64_t H = 7168, top_k = 4, tokens[2] = {100, 77};
  std::vector<std::vector<uint16_t>> xs;
  for (int r = 0; r < 2; ++r) xs.push_back(random_bf16(size_t(tokens[r] * H), 41 + uint64_t(r), 2.0));
  std::vector<int32_t> src_rank(Routed::kRows, -1), src_slot(Routed::kRows, 0);
  std::vector<uint16_t> copied(size_t(Routed::kRows * H), 0);
  uint64_t lcg = 12345;
  for (int64_t row = 0; row < Routed::kRows; ++row) {
    if (!routed.valid(row)) continue;
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    const int rank = int((lcg >> 33) % 2);
    const int64_t slot = int64_t((lcg >> 40) % uint64_t(tokens[rank] * top_k));
    src_rank[size_t(row)] = rank;
    src_slot[size_t(row)] = int32_t(slot);
    std::copy_n(xs[size_t(rank)].begin() + (slot / top_k) * H, H, copied.begin() + row * H);
  }
  DevBuf x0(xs[0].size() * 2), x1(xs[1].size() * 2), peers(16), dr(src_rank.size() * 4), ds(src_slot.size() * 4),
      dc(copied.size() * 2), abort_word(4);
  upload(x0, xs[0]);
  upload(x1, xs[1]);
  upload(peers, std::vector<const void*>{x0.p, x1.p});
  upload(dr, src_rank);
  upload(ds, src_slot);
  upload(dc, copied);
  MOK_ASSERT_CUDA(cudaMemset(abort_word.p, 0, 4));
  const size_t nt = size_t(Routed::kRows * H), nts = size_t(Routed::kRows / 128 * H);
  DevBuf t1(nt), ts1(nts * 4), t2(nt), ts2(nts * 4);
  for (DevBuf* b : {&t1, &ts1, &t2, &ts2}) MOK_ASSERT_CUDA(cudaMemset(b->p, 0xAB, b->bytes));
  mok::gemm::RowGather g;
  g.peers = peers.as<const void*>();
  g.src_rank = dr.as<int32_t>();
  g.src_slot = ds.as<int32_t>();
  g.top_k = top_k;
  g.abort = abort_word.as<uint32_t>();
  for (const bool mx : {false, true}) {  // recipe 1's blocks and MXFP8's re-blocked ones
    SCOPED_TRACE(mx ? "mxfp8" : "fp8");
    mok::gemm::quantize_fp8_token_blocks_t(dc.p, Routed::kRows, H, t1.p, ts1.as<float>(), nullptr, routed.seg(), mx);
    mok::gemm::quantize_fp8_token_blocks_t_gather(g, Routed::kRows, H, t2.p, ts2.as<float>(), nullptr, routed.seg(),
                                                  mx);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(count_diff(download<uint8_t>(t2, nt), download<uint8_t>(t1, nt)), 0) << "codes differ";
    EXPECT_EQ(count_diff(download<float>(ts2, nts), download<float>(ts1, nts)), 0) << "scales differ";
  }
  const uint32_t one = 1;
  MOK_ASSERT_CUDA(cudaMemcpy(abort_word.p, &one, 4, cudaMemcpyHostToDevice));
  mok::gemm::quantize_fp8_token_blocks_t_gather(g, Routed::kRows, H, t2.p, ts2.as<float>(), nullptr, routed.seg());
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  EXPECT_EQ(count_diff(download<uint8_t>(t2, nt), std::vector<uint8_t>(nt, 0)), 0) << "an aborted gather read rows";
  EXPECT_EQ(count_diff(download<float>(ts2, nts), std::vector<float>(nts, 1.0f)), 0)
      << "an aborted gather's blocks are all-zero blocks (scale 1)";
}

// MXFP8's weight-gradient operands (the token-block quantizers' mx form): each column's 32-row runs
// are MX blocks re-encoded at the 128 x 1 block's largest scale. The spec: the transposed,
// zero-padded matrix [cols, ld] through quantize_mxfp8 (1 x 32 blocks: 32 tokens) and reblock_mxfp8
// (1 x 128), rows past the data zero codes; the GPU's scales are [ld / 128, cols]. On the shapes
// above (NaN, Inf, zero and subnormal blocks planted), on the routed layout (padding rows hold
// data the blocks must not see), and gathered where the rows live (== the copied rows' bits).
void mx_token_blocks_spec(const std::vector<uint16_t>& x, int64_t rows, int64_t cols, const std::vector<bool>& valid,
                          std::vector<uint8_t>& q_t, std::vector<float>& scales) {
  const int64_t ld = (rows + fp8::kBlock - 1) / fp8::kBlock * fp8::kBlock, blocks = ld / fp8::kBlock;
  std::vector<float> t(size_t(cols * ld), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    if (valid[size_t(r)])
      for (int64_t c = 0; c < cols; ++c) t[size_t(c * ld + r)] = float(mok::bf16::from_bits(x[size_t(r * cols + c)]));
  std::vector<uint8_t> mq(t.size()), ms(size_t(fp8::scale_count(cols, ld, fp8::kMxBlockShape)));
  fp8::quantize_mxfp8(t.data(), cols, ld, mq.data(), ms.data());
  std::vector<float> s(size_t(cols * blocks));
  q_t.assign(t.size(), 0);
  fp8::reblock_mxfp8(mq.data(), ms.data(), cols, ld, fp8::kActivationBlock, q_t.data(), s.data());
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < ld; ++r)
      if (r >= rows || !valid[size_t(r)]) q_t[size_t(c * ld + r)] = 0;
  scales.assign(s.size(), 0.0f);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t b = 0; b < blocks; ++b) scales[size_t(b * cols + c)] = s[size_t(c * blocks + b)];
}

TEST(Fp8Quantize, MxTokenBlocksMatchTheSpec) {
  MOK_REQUIRE_GPUS(1);
  int64_t values = 0;
  const auto check = [&](const std::vector<uint16_t>& x, int64_t rows, int64_t cols, const std::vector<bool>& valid,
                         const mok::gemm::RoutedSegments& seg) {
    std::vector<uint8_t> want_q;
    std::vector<float> want_s;
    mx_token_blocks_spec(x, rows, cols, valid, want_q, want_s);
    DevBuf dx(x.size() * 2), dq(want_q.size()), ds(want_s.size() * 4);
    upload(dx, x);
    MOK_ASSERT_CUDA(cudaMemset(dq.p, 0xAB, dq.bytes));
    mok::gemm::quantize_fp8_token_blocks_t(dx.p, rows, cols, dq.p, ds.as<float>(), nullptr, seg, /*mx=*/true);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(count_diff(download<uint8_t>(dq, want_q.size()), want_q), 0) << "codes differ";
    EXPECT_EQ(count_diff(download<float>(ds, want_s.size()), want_s), 0) << "scales differ";
    values += rows * cols;
  };
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.rows << " x " << s.cols);
    std::vector<uint16_t> x = matrix(s, 23 + uint64_t(s.rows));
    if (s.rows >= 128 && s.cols >= 1024)  // a tiny MX block (rows 32-63) beside a huge one in column 1000
      for (int64_t r = 0; r < 64; ++r) x[size_t(r * s.cols + 1000)] = r < 32 ? 0x5380 : 0x0080;
    check(x, s.rows, s.cols, std::vector<bool>(size_t(s.rows), true), {});
  }
  {
    SCOPED_TRACE("routed segments");
    const Routed routed;
    const int64_t cols = 384;
    const std::vector<uint16_t> x = random_bf16(size_t(Routed::kRows * cols), 29, 3.0);
    std::vector<bool> valid(Routed::kRows);
    for (int64_t r = 0; r < Routed::kRows; ++r) valid[size_t(r)] = routed.valid(r);
    check(x, Routed::kRows, cols, valid, routed.seg());
  }
  std::printf("[fp8 quantize] MXFP8 re-blocked 128 x 1 token blocks, transposed: %lld values compared with the spec\n",
              (long long)values);
  EXPECT_GE(values, 1000000);
}

TEST(Fp8Quantize, MxMatchesTheSpecBitForBit) {
  MOK_REQUIRE_GPUS(1);
  int64_t values = 0;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.rows << " x " << s.cols);
    const std::vector<uint16_t> x = matrix(s, 11 + uint64_t(s.rows));
    const size_t n = x.size(), ns = size_t(fp8::scale_count(s.rows, s.cols, fp8::kMxBlockShape));
    std::vector<uint8_t> want_q(n), want_s(ns);
    fp8::quantize_mxfp8(reinterpret_cast<const mok::bf16*>(x.data()), s.rows, s.cols, want_q.data(), want_s.data());
    DevBuf dx(n * 2), dq(n), ds(ns);
    upload(dx, x);
    mok::gemm::quantize_mxfp8(dx.p, s.rows, s.cols, dq.p, ds.as<uint8_t>(), nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(count_diff(download<uint8_t>(dq, n), want_q), 0) << "codes differ";
    EXPECT_EQ(count_diff(download<uint8_t>(ds, ns), want_s), 0) << "scales differ";
    values += int64_t(n);
  }
  std::printf("[fp8 quantize] MXFP8: %lld values compared with the spec\n", (long long)values);
  EXPECT_GE(values, 1000000);
}

// MXFP8 re-blocked in one pass: the spec's two steps (quantize_mxfp8, then reblock_mxfp8 to 1 x 128
// and to 128 x 128 blocks), bit for bit, on the shapes above (partial blocks included) and with a
// NaN, an Inf and a tiny MX block planted next to large ones.
TEST(Fp8Quantize, MxReblockedMatchesTheSpec) {
  MOK_REQUIRE_GPUS(1);
  int64_t values = 0;
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(testing::Message() << s.rows << " x " << s.cols);
    std::vector<uint16_t> x = matrix(s, 19 + uint64_t(s.rows));
    if (s.rows >= 3 && s.cols >= 1024) {  // in block 7 (columns 896-1023), clear of matrix()'s plants
      x[size_t(0 * s.cols + 936)] = 0x7fc0;  // a NaN in one MX block of row 0's 1 x 128 block 7
      x[size_t(1 * s.cols + 1000)] = 0x7f80;  // +Inf in row 1's
      for (int64_t c = 896; c < 928; ++c) x[size_t(2 * s.cols + c)] = 0x0080;  // a tiny MX block (2^-126)
      x[size_t(2 * s.cols + 990)] = 0x5380;  // beside a huge one (2^40): the shift passes 2^-149 (factor 0)
    }
    const size_t n = x.size(), n_mx = size_t(fp8::scale_count(s.rows, s.cols, fp8::kMxBlockShape));
    std::vector<uint8_t> mx_q(n), mx_s(n_mx);
    fp8::quantize_mxfp8(reinterpret_cast<const mok::bf16*>(x.data()), s.rows, s.cols, mx_q.data(), mx_s.data());
    DevBuf dx(n * 2), dq(n);
    upload(dx, x);
    for (const fp8::BlockShape block : {fp8::kActivationBlock, fp8::kWeightBlock}) {
      SCOPED_TRACE(testing::Message() << "blocks of " << block.rows << " x " << block.cols);
      const size_t ns = size_t(fp8::scale_count(s.rows, s.cols, block));
      std::vector<uint8_t> want_q(n);
      std::vector<float> want_s(ns);
      fp8::reblock_mxfp8(mx_q.data(), mx_s.data(), s.rows, s.cols, block, want_q.data(), want_s.data());
      DevBuf ds(ns * 4);
      MOK_ASSERT_CUDA(cudaMemset(dq.p, 0xAB, n));
      mok::gemm::quantize_mxfp8_reblocked(dx.p, s.rows, s.cols, int(block.rows), dq.p, ds.as<float>(), nullptr);
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      EXPECT_EQ(count_diff(download<uint8_t>(dq, n), want_q), 0) << "codes differ";
      EXPECT_EQ(count_diff(download<float>(ds, ns), want_s), 0) << "scales differ";
      values += int64_t(n);
    }
  }
  std::printf("[fp8 quantize] MXFP8 re-blocked (1 x 128 and 128 x 128): %lld values compared with the spec\n",
              (long long)values);
  EXPECT_GE(values, 1000000);
}

// The dgrads' weight codes in one pass: the same bits as the two-step path (transpose_weights_bf16
// then the 128 x 128 quantizer, which test_fp8_dgrad.cu checks against the spec), for W^T and for
// the packed [W_gate; W_up]^T, with a NaN, an Inf and an all-zero block planted, both scale rules,
// and MXFP8 re-blocked (then the quantizer is quantize_mxfp8_reblocked, checked above).
TEST(Fp8Quantize, WeightsInOnePassMatchTheTwoStepPath) {
  MOK_REQUIRE_GPUS(1);
  const int64_t E = 3, rows = 384, cols = 256;  // K = 384, packed 768 (not square: rows and cols apart)
  std::vector<uint16_t> w = random_bf16(size_t(E * rows * cols), 31, 0.05), w_up = random_bf16(w.size(), 37, 0.05);
  w[size_t(1 * rows * cols + 5 * cols + 7)] = 0x7fc0;    // expert 1: a NaN
  w_up[size_t(2 * rows * cols + 70 * cols + 200)] = 0xff80;  // expert 2: -Inf (in an up row)
  for (int64_t r = 0; r < 128; ++r)  // expert 0: an all-zero output block in both orders (K block 0,
    for (int64_t c = 128; c < 256; ++c) {  // columns 128-255: gate rows 0-127, up rows 0-63)
      w[size_t(r * cols + c)] = 0;
      if (r < 64) w_up[size_t(r * cols + c)] = 0;
    }
  DevBuf dw(w.size() * 2), du(w.size() * 2), tmp(w.size() * 4);
  upload(dw, w);
  upload(du, w_up);
  int64_t values = 0;
  for (const bool packed : {false, true})
    for (const int mode : {0, 1, 2}) {  // fp32 scales, pow2 scales, MXFP8 re-blocked (the MX backward's)
      const fp8::ScaleRule rule = mode == 1 ? fp8::ScaleRule::Pow2 : fp8::ScaleRule::Fp32;
      const bool mx = mode == 2;
      SCOPED_TRACE(testing::Message() << (packed ? "packed gate/up" : "plain") << ", "
                                      << (mx ? "mxfp8" : mode == 0 ? "rule fp32" : "rule pow2"));
      const int64_t k = packed ? 2 * rows : rows, n = E * cols * k, ns = n / (128 * 128);
      const void* up = packed ? du.p : nullptr;
      DevBuf q1{static_cast<size_t>(n)}, s1{static_cast<size_t>(ns) * 4}, q2{static_cast<size_t>(n)},
          s2{static_cast<size_t>(ns) * 4};
      mok::gemm::transpose_weights_bf16(dw.p, up, E, rows, cols, tmp.p, nullptr);
      if (mx)
        mok::gemm::quantize_mxfp8_reblocked(tmp.p, E * cols, k, 128, q1.p, s1.as<float>(), nullptr);
      else
        mok::gemm::quantize_fp8_blocked(tmp.p, E * cols, k, 128, rule, q1.p, s1.as<float>(), nullptr);
      mok::gemm::quantize_fp8_weights_t(dw.p, up, E, rows, cols, rule, q2.p, s2.as<float>(), nullptr, mx);
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      EXPECT_EQ(count_diff(download<uint8_t>(q2, size_t(n)), download<uint8_t>(q1, size_t(n))), 0) << "codes differ";
      EXPECT_EQ(count_diff(download<float>(s2, size_t(ns)), download<float>(s1, size_t(ns))), 0) << "scales differ";
      values += n;
    }
  std::printf("[fp8 quantize] weights in one pass: %lld codes compared with the two-step path\n", (long long)values);
  // Shapes that cut an output block, and a misaligned weight: named errors, nothing launched.
  const auto refused = [&](int64_t r, int64_t c, const void* p) {
    try {
      mok::gemm::quantize_fp8_weights_t(p, nullptr, 1, r, c, fp8::ScaleRule::Fp32, tmp.p, tmp.as<float>(), nullptr);
    } catch (const mok::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(refused(192, 256, dw.p).find("'rows, cols'"), std::string::npos);  // K = 192
  EXPECT_NE(refused(128, 200, dw.p).find("'rows, cols'"), std::string::npos);
  EXPECT_NE(refused(128, 128, static_cast<const uint8_t*>(dw.p) + 2).find("'w, w_up, q_t'"), std::string::npos);
}

TEST(Fp8Quantize, RefusesBadArgumentsByName) {
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const mok::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  uint8_t q = 0;
  float s = 0;
  uint16_t x = 0;
  // (mok::Error's text names the argument in quotes: "invalid argument 'rows'".)
  EXPECT_NE(message([&] { mok::gemm::quantize_fp8_blocked(&x, -1, 4, 1, fp8::ScaleRule::Fp32, &q, &s, nullptr); })
                .find("'rows'"),
            std::string::npos);
  EXPECT_NE(message([&] { mok::gemm::quantize_fp8_blocked(&x, 4, 4, 64, fp8::ScaleRule::Fp32, &q, &s, nullptr); })
                .find("'block_rows'"),
            std::string::npos);
  EXPECT_NE(message([&] { mok::gemm::quantize_mxfp8(nullptr, 4, 4, &q, nullptr, nullptr); }).find("'in'"),
            std::string::npos);
  // Nothing to do: no launch, no error (and no device needed).
  EXPECT_EQ(message([&] { mok::gemm::quantize_mxfp8(nullptr, 0, 4, nullptr, nullptr, nullptr); }), "no error");
}

// Tiles of no expert (tile_expert -1: the layout past the routed rows, most of it at EP 8) are not
// written in either form; tile 0 is as without them.
TEST(Fp8Quantize, TilesOfNoExpertAreNotWritten) {
  MOK_REQUIRE_GPUS(1);
  const int64_t rows = 384, cols = 512, ld = rows;
  const std::vector<int32_t> te{0, -1, -1}, begin{0}, count{100};
  DevBuf dte(te.size() * 4), db(4), dn(4);
  upload(dte, te);
  upload(db, begin);
  upload(dn, count);
  const mok::gemm::RoutedSegments seg{dte.as<int32_t>(), db.as<int32_t>(), dn.as<int32_t>(), 3};
  const std::vector<uint16_t> x = random_bf16(size_t(rows * cols), 77, 2.0);
  DevBuf dx(x.size() * 2), q(size_t(rows * cols)), qs(size_t(rows * cols / 128) * 4), t(size_t(cols * ld)),
      ts(size_t(ld / 128 * cols) * 4), t1(size_t(cols * ld)), ts1(size_t(ld / 128 * cols) * 4);
  upload(dx, x);
  for (DevBuf* b : {&q, &qs, &t, &ts, &t1, &ts1}) MOK_ASSERT_CUDA(cudaMemset(b->p, 0xAB, b->bytes));
  mok::gemm::quantize_fp8_rows_and_token_blocks_t(dx.p, rows, cols, fp8::ScaleRule::Fp32, q.p, qs.as<float>(), t.p,
                                                  ts.as<float>(), nullptr, seg);
  const mok::gemm::RoutedSegments one{dte.as<int32_t>(), db.as<int32_t>(), dn.as<int32_t>(), 1};  // tile 0 only
  mok::gemm::quantize_fp8_token_blocks_t(dx.p, rows, cols, t1.p, ts1.as<float>(), nullptr, one);
  ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
  const auto codes = download<uint8_t>(t, size_t(cols * ld)), codes1 = download<uint8_t>(t1, size_t(cols * ld));
  const auto rq = download<uint8_t>(q, size_t(rows * cols));
  const auto rs = download<float>(qs, size_t(rows * cols / 128)), tsc = download<float>(ts, size_t(ld / 128 * cols));
  const auto poison = [](float f) {
    uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    return u == 0xABABABABu;
  };
  int64_t written = 0, differ = 0;
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < ld; ++r) {
      const size_t i = size_t(c * ld + r);
      if (r >= 128) written += codes[i] != 0xAB;
      else differ += codes[i] != codes1[i];
    }
  for (int64_t r = 128; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) written += rq[size_t(r * cols + c)] != 0xAB;
  for (int64_t r = 128; r < rows; ++r)
    for (int64_t b = 0; b < cols / 128; ++b) written += !poison(rs[size_t(r * (cols / 128) + b)]);
  for (int64_t b = 1; b < ld / 128; ++b)
    for (int64_t c = 0; c < cols; ++c) written += !poison(tsc[size_t(b * cols + c)]);
  EXPECT_EQ(written, 0) << "bytes written in the tiles of no expert";
  EXPECT_EQ(differ, 0) << "tile 0's token-block codes differ from the pass over tile 0 alone";
}

}  // namespace
