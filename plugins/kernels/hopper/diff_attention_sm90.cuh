// The Hopper (sm_90a) prefill path: warp-specialised, TMA loads into a multi-stage shared-memory
// pipeline with mbarriers, wgmma for Q.K^T and P.V, built from CuTe/CUTLASS (the nvidia-cutlass
// wheel's headers; CMake finds them, nothing of CUTLASS is copied here).
//
// One CTA = one block of 64 query tokens of one diff-head of one batch element, 3 warpgroups:
//   warpgroup 0 (producer): one elected thread issues the TMA loads: Q1 and Q2 once, then every
//     64-key tile (K1 and K2, or V2's shared K, and V) into a kStages-deep ring; its registers are
//     handed to the consumers (setmaxnreg).
//   warpgroups 1 and 2 (consumers): map 1 and map 2. Each runs S = Q_m K_m^T (wgmma, both operands
//     from shared memory), the online softmax of its map on the accumulator in registers, and
//     O_m += P_m V (wgmma, P from registers, V from shared memory), with its own running max, sum
//     and fp32 accumulator. The two maps are independent until the epilogue, so one warpgroup's
//     softmax runs while the other's wgmma occupies the tensor cores (DIFFX_SM90_PINGPONG=1 makes
//     them take turns).
// With -DDIFFX_SM90_PERSISTENT=1 (where the epilogue's scratch fits beside the ring) one CTA an SM
// takes such tiles in turn, the producer loading a tile's K/V and Q while the consumers finish the last.
// With -DDIFFX_SM90_CLUSTER_M=2 the CTAs of two adjacent query blocks form a cluster: each producer
// loads half of every K/V tile and multicasts it into both rings, and each consumer releases a stage
// to both producers (CUTLASS's PipelineTmaAsync over the cluster shape).
// Epilogue as in the mma.sync kernel: map 2 leaves O2/l2 in shared memory (the ring's space, no
// longer needed), map 1 writes norm(O1/l1 - lambda * O2/l2) * weight * output_scale.
//
// Same contract as diff_attention_fwd.cuh: fp16/bf16, D 64/128, V1 (V of 2D, two key maps) and V2
// (shared K/V of D, lambda [B, Sq, H]), causal bottom-right or none, GQA, key_mask, any lengths
// (TMA zero-fills rows past the end; masks hide them), the contract's free batch/row strides.
// INT8 logits (logit_bits 2..8, the instantiations with INT8 = true): K comes as the pre-pass's
// codes (quantize_keys.cuh, TMA-loaded like K), each consumer quantises its Q map into codes in
// shared memory once, S = Q8 K8^T runs on s8 wgmma into an int32 accumulator, and the logits are
// fp32(integer sum) * (scale_q * scale_k), the mma.sync kernel's and diffexport/core/quantization.py's
// arithmetic, so the mirrored-quantisation tests hold unchanged. float32 I/O is converted before.
//
// The accumulator of a 64 x N wgmma is the mma.sync m16n8 layout repeated (acc_row/acc_col in
// diff_attention_sm90_config.cuh), so the softmax below reads it exactly as the mma.sync kernel
// reads its fragments. The register A operand of the 64 x DV x 64 P.V wgmma has the same linear
// order, so P is the accumulator converted in place. hopper/layout_check.cu verifies both on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "../kernel_args.h"
#include "../key_flags.cuh"
#include "../ptx.cuh"
#include "diff_attention_sm90.h"
#include "diff_attention_sm90_config.cuh"
#include "exp2_fma.h"

namespace diffx::sm90 {

template <typename Element, int D, int DV, bool INT8>
struct Params {
  using Cfg = Config<Element, D, DV, INT8>;
  typename Cfg::TmaQ tma_q;
  typename Cfg::TmaK tma_k;
  typename Cfg::TmaV tma_v;
  typename Cfg::GmemShape shape_q, shape_k, shape_v;
  KernelArgs args;
};

template <typename Element>
__device__ __forceinline__ float to_f(Element x) {
  return float(x);
}

template <typename Element, int D, int DV, bool INT8>
__global__ void __launch_bounds__(kThreads, 1) diff_attention_sm90_kernel(const __grid_constant__ Params<Element, D, DV, INT8> prm) {
  using Cfg = Config<Element, D, DV, INT8>;
  using Pipeline = typename Cfg::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& storage = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const DiffxAttentionParams& p = prm.args.p;

  const int warpgroup = cutlass::canonical_warp_group_idx();
  constexpr int kBlockRows = Cfg::kBlockRows;  // query rows a tile: 64, or 128 with both maps a warpgroup
  const int m_blocks = (p.q_len + kBlockRows - 1) / kBlockRows;
  constexpr int kBlockN = Cfg::kKeyBlock;
  constexpr bool kPersistent = Cfg::kPersistent;
  const int n_total = (p.kv_len + kBlockN - 1) / kBlockN;
  // A tile is (query block, head, batch element), in the mma.sync kernel's grid order
  // (attention_grid): the blocks of a head together, its heaviest (causal) first. One tile a CTA,
  // from its block index; persistent, the tiles blockIdx.x, blockIdx.x + gridDim.x, ... of that order.
  const int num_tiles = kPersistent ? m_blocks * p.num_heads * p.batch : 1;
  const int first_tile = kPersistent ? int(blockIdx.x) : 0;
  const int tile_stride = kPersistent ? int(gridDim.x) : 1;
  int m_block = 0, m_start = 0, h = 0, b = 0, g = 0, n_end = 0;
  // The tile's coordinates and its count of key tiles. A cluster of 2 rounds the grid up to an even
  // count: the extra CTA (m_block == m_blocks, past the end) loads its half of the shared tiles and
  // writes nothing; the CTAs of a cluster consume as many key tiles as its heavier (first) real
  // block needs, the lighter block's extra causal tile masked out whole.
  auto enter_tile = [&](int tile) {
    int lead_block = 0;
    if constexpr (kPersistent) {
      m_block = m_blocks - 1 - tile % m_blocks;
      h = tile / m_blocks % p.num_heads;
      b = tile / m_blocks / p.num_heads;
      lead_block = m_block;
    } else {
      m_block = int(gridDim.x) - 1 - int(blockIdx.x);
      h = int(blockIdx.y);
      b = int(blockIdx.z);
      lead_block = min(int(gridDim.x) - 1 - int(blockIdx.x) / kClusterM * kClusterM, m_blocks - 1);
    }
    m_start = m_block * kBlockRows;
    g = h / (p.num_heads / p.num_kv_heads);
    const int lead_start = lead_block * kBlockRows;
    n_end = n_total;
    if (p.causal) {
      const int last_key = lead_start + min(kBlockRows, p.q_len - lead_start) - 1 + p.kv_len - p.q_len;
      n_end = last_key < 0 ? 0 : min(n_total, last_key / kBlockN + 1);
    }
  };

  // Row blocks of the tile that hold a query row: with both maps a warpgroup, the last tile's second
  // may hold none. (One row block a CTA: always loaded, the cluster's extra CTA past the end included.)
  auto row_blocks_live = [&] {
    if constexpr (Cfg::kBothMaps) return min(Cfg::kRowBlocks, (p.q_len - m_start + kBlockM - 1) / kBlockM);
    else return 1;
  };

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kStageBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = 2 * cutlass::NumThreadsPerWarpGroup;
  using QBarrier = cutlass::arch::ClusterTransactionBarrier;
  if (threadIdx.x == 0) {
    QBarrier::init(&storage.q_loaded, 1);
    if constexpr (kPersistent) cutlass::arch::ClusterBarrier::init(&storage.persistent.q_free, 2 * cutlass::NumThreadsPerWarpGroup);
  }
  Pipeline pipeline(storage.pipeline, pipe_params, ClusterShape{});
  // Barriers initialised (and fenced) before anyone waits on them; in a cluster, before the other
  // CTA multicasts into this one or arrives on its barriers.
  if constexpr (kClusterM > 1) cute::cluster_sync();
  else __syncthreads();

  // Q of each map for the 64 rows of row block `block` (0 but with both maps a warpgroup).
  auto q_tile = [&](int block, int map) {
    return make_tensor(make_smem_ptr(storage.q[2 * block + map].data()), typename Cfg::SmemLayoutQ{});
  };

  if (warpgroup == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();  // (a cluster's slices and multicast too)
    if (threadIdx.x != 0) return;
    Tensor mQ = prm.tma_q.get_tma_tensor(prm.shape_q);
    Tensor mK = prm.tma_k.get_tma_tensor(prm.shape_k);
    Tensor mV = prm.tma_v.get_tma_tensor(prm.shape_v);
    // This CTA's slice of each shared tile (all of it without a cluster), into every CTA of the cluster.
    const int rank = kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;
    constexpr uint16_t kMulticast = (1u << kClusterM) - 1;
    auto state = cutlass::make_producer_start_state<Pipeline>();
    int iter = 0;
    for (int tile = first_tile; tile < num_tiles; tile += tile_stride, ++iter) {
      enter_tile(tile);
      // Persistent: this tile's Q replaces the last one's once both consumers are done with it (past
      // their last wgmma), so after a later tile's first K/V stage is on its way: that stage's slot
      // frees while the consumers are still on the last tile.
      auto load_q = [&] {
        if constexpr (kPersistent)
          if (iter > 0) cutlass::arch::ClusterBarrier::wait(&storage.persistent.q_free, (iter - 1) & 1);
        // A row block wholly past q_len is not loaded (its consumer reads no Q, below).
        const int live_blocks = row_blocks_live();
        QBarrier::arrive_and_expect_tx(&storage.q_loaded, Cfg::kQBytes / Cfg::kRowBlocks * live_blocks);
        for (int block = 0; block < live_blocks; ++block)
          for (int m = 0; m < 2; ++m) {
            Tensor gQ = local_tile(mQ(_, _, 2 * h + m, b), Shape<_64, Int<D>>{},
                                   make_coord(m_block * Cfg::kRowBlocks + block, 0));
            auto [tQg, tQs] = tma_partition(prm.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(q_tile(block, m)),
                                            group_modes<0, 2>(gQ));
            copy(prm.tma_q.with(storage.q_loaded), tQg, tQs);
          }
      };
      const bool q_after_first_stage = kPersistent && iter > 0 && n_end > 0;
      if (!q_after_first_stage) load_q();
      for (int nb = 0; nb < n_end; ++nb) {
        pipeline.producer_acquire(state);
        uint64_t* full = pipeline.producer_get_barrier(state);
        for (int m = 0; m < Cfg::kKeyMaps; ++m) {
          const int km = Cfg::kV1 ? 2 * g + m : g;
          Tensor sK = make_tensor(make_smem_ptr(storage.ring.k[m].data()), typename Cfg::SmemLayoutK{});
          Tensor gK = local_tile(mK(_, _, km, b), Shape<typename Cfg::KeyBlock, Int<D>>{}, make_coord(nb, 0));
          auto [tKg, tKs] = tma_partition(prm.tma_k, rank, Layout<Int<kClusterM>>{},
                                          group_modes<0, 2>(sK(_, _, state.index())), group_modes<0, 2>(gK));
          copy(prm.tma_k.with(*full, kMulticast), tKg, tKs);
        }
        Tensor sV = make_tensor(make_smem_ptr(storage.ring.v.data()), typename Cfg::SmemLayoutV{});
        Tensor gV = local_tile(mV(_, _, g, b), Shape<typename Cfg::KeyBlock, Int<DV>>{}, make_coord(nb, 0));
        auto [tVg, tVs] = tma_partition(prm.tma_v, rank, Layout<Int<kClusterM>>{},
                                        group_modes<0, 2>(sV(_, _, state.index())), group_modes<0, 2>(gV));
        copy(prm.tma_v.with(*full, kMulticast), tVg, tVs);
        ++state;
        if (q_after_first_stage && nb == 0) load_q();
      }
    }
    // In a cluster the other CTA's consumers arrive on this CTA's barriers: stay until they have
    // released every stage.
    if constexpr (kClusterM > 1) pipeline.producer_tail(state);
    return;
  }

  // Consumers. One map a warpgroup (the default): warpgroup 1 runs map 1 and warpgroup 2 map 2 over
  // the tile's 64 rows. Both maps a warpgroup (Cfg::kBothMaps): warpgroup 1 + c runs map 1 and map 2
  // over row block c, the tile's rows 64c..64c+63, holding a second set of the state below (slot 1).
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  constexpr bool kBothMaps = Cfg::kBothMaps;
  const int map = kBothMaps ? 0 : warpgroup - 1;        // the (first) map this warpgroup runs
  const int row_block = kBothMaps ? warpgroup - 1 : 0;  // the block of its 64 rows in the tile
  const int tid = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
  typename Cfg::TiledMmaS mma_s;
  typename Cfg::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  auto key_tiles = [&](int m) {
    return make_tensor(make_smem_ptr(storage.ring.k[Cfg::kV1 ? m : 0].data()), typename Cfg::SmemLayoutK{});
  };
  Tensor sVt = make_tensor(make_smem_ptr(storage.ring.v.data()), typename Cfg::SmemLayoutVt{});
  // S's A operand: Q of map m for this warpgroup's rows, or (INT8) its codes, written below once Q
  // has landed.
  auto q_operand = [&](int m) {
    if constexpr (INT8) return make_tensor(make_smem_ptr(storage.q_codes.q[m].data()), typename Cfg::SmemLayoutQCodes{});
    else return q_tile(row_block, m);
  };
  auto sQ_operand = q_operand(map);
  Tensor tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ_operand));
  Tensor tSrK = thr_s.make_fragment_B(thr_s.partition_B(key_tiles(map)));
  Tensor tOrV = thr_o.make_fragment_B(thr_o.partition_B(sVt));
  Tensor acc_o = partition_fragment_C(mma_o, Shape<_64, Int<DV>>{});

  const float scale_log2 = prm.args.scale * kLog2e;
  // Per tile (set where each tile starts): the key mask's row, the running max and sum of each row,
  // of each map a warpgroup runs (slot 0; with both maps, map 2's in slot 1).
  const int64_t* mask_row = nullptr;
  float row_max[2][2], row_sum[2][2];

  // S = Q K^T of the stage's key tile into acc_s, issued (not waited for).
  auto issue_qk = [&](auto& acc_s, auto& tSrQ, auto& tSrK, int stage) {
    warpgroup_fence_operand(acc_s);
    warpgroup_arrive();
    // The first k-block overwrites the accumulator, the others add to it (one gemm call over all
    // of K would overwrite at every k-block).
    mma_s.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
      gemm(mma_s, tSrQ(_, _, kb), tSrK(_, _, kb, stage), acc_s);
      mma_s.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  // O += P V of the stage's value tile, issued (not waited for); P stays read until the wait.
  auto issue_pv = [&](auto& tOrP, auto& acc_o, int stage) {
    mma_o.accumulate_ = GMMA::ScaleOut::One;
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    gemm(mma_o, tOrP, tOrV(_, _, _, stage), acc_o);
    warpgroup_commit_batch();
  };
  // INT8: this map's Q tile as codes, exactly as diffexport/core/quantization.py and the mma.sync
  // kernel's quantise_q_tile: one absmax over the block's 64 tokens x D channels (rows past q_len
  // are TMA's zeros), inv = qmax/absmax, code = clamp(rint(x*inv)); returns scale = absmax/qmax.
  auto quantise_q = [&]() -> float {
    constexpr int kWarpgroupThreads = cutlass::NumThreadsPerWarpGroup;
    Tensor q = q_tile(0, map);
    float amax = 0.f;
    for (int i = tid; i < kBlockM * D; i += kWarpgroupThreads) amax = fmaxf(amax, fabsf(to_f(q(i / D, i % D))));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((tid & 31) == 0) storage.q_absmax[map][tid >> 5] = amax;
    cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, kQuantBarrier + map);
    amax = fmaxf(fmaxf(storage.q_absmax[map][0], storage.q_absmax[map][1]),
                 fmaxf(storage.q_absmax[map][2], storage.q_absmax[map][3]));
    if (!(amax > 0.f)) amax = 1.f;  // all-zero block: codes are 0 whatever the scale
    const int qmax = prm.args.qmax;
    const float inv = float(qmax) / amax;
    for (int i = tid; i < kBlockM * D; i += kWarpgroupThreads) {
      const int code = max(-qmax, min(qmax, __float2int_rn(to_f(q(i / D, i % D)) * inv)));
      if constexpr (INT8) sQ_operand(i / D, i % D) = static_cast<int8_t>(code);  // (the fp path never calls this)
    }
    cutlass::arch::fence_view_async_shared();  // the codes, written by threads, are read by wgmma
    cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, kQuantBarrier + map);
    return amax / float(qmax);
  };
  // Tile nb's present keys (key_flags.cuh: before kv_len, and not padding under key_mask) as bits,
  // called once its S is issued, so that the flags' loads run beside the wgmma; all present without
  // a load where there is no key_mask and the tile ends before kv_len.
  using KeyBits = typename KeyFlags<kBlockN>::Bits;
  auto tile_keys = [&](int nb) -> KeyBits {
    const int n_start = nb * kBlockN;
    if (!mask_row && n_start + kBlockN <= p.kv_len) return KeyFlags<kBlockN>::kAll;
    return present_keys(key_flags<kBlockN>(mask_row, p.kv_len, tid & 31, [&](int j) { return n_start + j; }));
  };
  // Masks, then the online softmax of tile nb on the accumulator (rows acc_row(tid, 0) and
  // acc_row(tid, 2), the mma.sync kernel's arithmetic): acc_s becomes P, alpha the rescale of O.
  auto softmax = [&](auto& acc_s, int nb, KeyBits keys, float (&alpha)[2], int slot) {
    const int n_start = nb * kBlockN;
    float(&running_max)[2] = row_max[slot];
    float(&running_sum)[2] = row_sum[slot];
    const int rows_start = m_start + row_block * kBlockM;  // this warpgroup's first query row
    // Keys past the end or padding (not in `keys`), and after the bottom-right diagonal.
    const bool diagonal = p.causal && n_start + kBlockN - 1 > rows_start + p.kv_len - p.q_len;
    if (diagonal || keys != KeyFlags<kBlockN>::kAll) {
      const KeyBits mine = keys >> acc_key_shift(tid);  // value i's key: bit acc_col(0, i)
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) {
        const int key = n_start + acc_col(tid, i);
        const int qi = rows_start + acc_row(tid, i);
        const bool visible = ((mine >> acc_col(0, i)) & 1) && (!p.causal || key <= qi + p.kv_len - p.q_len);
        if (!visible) acc_s(i) = -INFINITY;
      }
    }
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      float mx = running_max[r];
      CUTE_UNROLL
      for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(acc_s(4 * j + 2 * r), acc_s(4 * j + 2 * r + 1)));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // DIFFX_SM90_RESCALE_SLACK > 0 (FA4's lazy max): the old max stays unless the new one exceeds
      // it by more than the slack (log2 units), so O is rescaled (almost) only on the first tiles;
      // P then reaches at most 2^slack, and O and the sum keep sharing one max, so the output is the
      // same up to rounding. (-inf, the max of a row with no key seen yet, always gives way.)
      if (DIFFX_SM90_RESCALE_SLACK > 0 && (mx - running_max[r]) * scale_log2 <= float(DIFFX_SM90_RESCALE_SLACK)) mx = running_max[r];
      alpha[r] = mx == running_max[r] ? 1.f : diffx::fast_exp2((running_max[r] - mx) * scale_log2);
      const float neg_max = mx == -INFINITY ? 0.f : -mx * scale_log2;
      running_max[r] = mx;
      float sum = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < kBlockN / 8; ++j)
        CUTE_UNROLL
        for (int c = 0; c < 2; ++c) {
          float& s = acc_s(4 * j + 2 * r + c);
          const float x = fmaf(s, scale_log2, neg_max);
          // (j is unrolled: which unit computes each exponential is fixed at compile time)
          s = DIFFX_SM90_EXP2_FMA_EVERY > 0 && j % cute::max(DIFFX_SM90_EXP2_FMA_EVERY, 1) ==
                                                  DIFFX_SM90_EXP2_FMA_EVERY - 1
                  ? diffx::fma_exp2(x)
                  : diffx::fast_exp2(x);
          sum += s;
        }
      running_sum[r] = running_sum[r] * alpha[r] + sum;
    }
  };
  // O *= alpha, skipped when no row of the warp has a new max (every factor is then exactly 1, so
  // the skip changes no bit), as the mma.sync kernel does: at D = 128 the multiply is 128 FMULs a
  // thread per tile, beside 32 exponentials, and after the first tiles most maxima stop growing.
  auto rescale_o = [&](auto& acc_o, const float (&alpha)[2]) {
    if (DIFFX_SM90_LAZY_RESCALE && !__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) acc_o(i) *= alpha[(i >> 1) & 1];
  };
  // S in fp32: the wgmma's accumulator, or (INT8) the dequantised copy of acc_qk, its int32 one.
  Tensor acc_qk = partition_fragment_C(mma_s, Shape<_64, typename Cfg::KeyBlock>{});
  Tensor acc_s = make_tensor<float>(partition_shape_C(mma_s, Shape<_64, typename Cfg::KeyBlock>{}));
  const float* k_scales = nullptr;  // INT8: this map's key-tile scales (per tile)
  float q_scale = 1.f, k_scale = 1.f;
  // S of tile nb issued (not waited for); its key scale read meanwhile.
  auto issue_s = [&](int stage, int nb) {
    if constexpr (INT8) {
      issue_qk(acc_qk, tSrQ, tSrK, stage);
      k_scale = k_scales[nb];
    } else {
      issue_qk(acc_s, tSrQ, tSrK, stage);
    }
  };
  // S landed: fp32 logits in acc_s (INT8: fp32(integer sum) * (scale_q * scale_k), as the reference).
  // (Converting the sums with the 1.5 * 2^23 bit trick instead of I2FP measured no faster on an
  // H100, 2026-11-26, docs/campaign/2026-11-26-h100-int8: the conversions are not what limits it.)
  auto land_s = [&] {
    if constexpr (INT8) {
      warpgroup_fence_operand(acc_qk);
      const float qk_scale = q_scale * k_scale;
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = __int2float_rn(acc_qk(i)) * qk_scale;
    } else {
      warpgroup_fence_operand(acc_s);
    }
  };
  // P (the accumulator, converted in place order) as the register A operand of P.V.
  Tensor tOrP = make_tensor<Element>(partition_shape_A(mma_o, Shape<_64, typename Cfg::KeyBlock>{}));
  static_assert(decltype(size(tOrP))::value == decltype(size(acc_s))::value, "P has the accumulator's values");
  auto convert_p = [&](auto& acc_s, auto& tOrP) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) tOrP(i) = Element(acc_s(i));
  };
  // Both maps a warpgroup: map 2's operands, accumulators and P beside map 1's above (unused, and
  // so left out by the compiler, with one map a warpgroup).
  Tensor tSrQ2 = thr_s.make_fragment_A(thr_s.partition_A(q_operand(1)));
  Tensor tSrK2 = thr_s.make_fragment_B(thr_s.partition_B(key_tiles(1)));
  Tensor acc_s2 = make_tensor<float>(partition_shape_C(mma_s, Shape<_64, typename Cfg::KeyBlock>{}));
  Tensor tOrP2 = make_tensor<Element>(partition_shape_A(mma_o, Shape<_64, typename Cfg::KeyBlock>{}));
  Tensor acc_o2 = partition_fragment_C(mma_o, Shape<_64, Int<DV>>{});

  typename Pipeline::PipelineState next_stage;  // the first stage not yet consumed: index 0, phase 0
  int iter = 0;
  for (int tile = first_tile; tile < num_tiles; tile += tile_stride, ++iter) {
    enter_tile(tile);
    mask_row = p.key_mask ? p.key_mask + b * p.mask_batch_stride : nullptr;
    if constexpr (INT8)
      k_scales = prm.args.k_scales + (int64_t(b) * prm.args.key_maps + (Cfg::kV1 ? 2 * g + map : g)) * prm.args.n_kv_blocks;
    for (int slot = 0; slot < 2; ++slot) {
      row_max[slot][0] = row_max[slot][1] = -INFINITY;
      row_sum[slot][0] = row_sum[slot][1] = 0.f;
    }
    clear(acc_o);
    auto state = next_stage;
    auto last_stage = state;  // both maps a warpgroup: the stage of the tile before
    float alpha[2];
    if constexpr (kBothMaps) {
      // A row block past q_len (the last tile's second, at most) has no Q: its warpgroup only
      // passes the stages on, each after it landed (the ring's empty barriers count both consumers).
      if (row_block >= row_blocks_live()) {
        for (int nb = 0; nb < n_end; ++nb, ++state) {
          pipeline.consumer_wait(state);
          pipeline.consumer_release(state);
        }
        continue;
      }
      clear(acc_o2);
      QBarrier::wait(&storage.q_loaded, iter & 1);
      // S1 and S2 of a tile are issued together, so that softmax(S1) runs while S2 is on the tensor
      // cores and softmax(S2) while P1.V is; P2.V of tile nb-1 and S1, S2 of tile nb follow one
      // another. Registers a wgmma reads (P, O) are written only where no wgmma is pending, and the
      // loop's back edge is such a point (after P1.V of tile nb-1, before its P2.V is issued):
      // where a wgmma is pending across the back edge, or its inputs are written while another
      // runs, ptxas serialises every wgmma of the kernel. The wait for S1 of tile nb is one for
      // P2.V of tile nb-1 too (wgmma groups complete in order), and tile nb-1's stage is released
      // there: the warpgroup holds two stages, hence kStages >= 3.
      // P2 of tile nb-1 still held (its P.V running) while S1 and S2 of tile nb are issued: where
      // registers allow (DV = 64; at DV = 128 O1, O2, S1, S2 and P2 take 208 of the 240 and ptxas
      // serialises the wgmmas for want of registers). Elsewhere P2.V is waited for first.
      constexpr bool kP2BesideNextS = DV <= 64;
      float alpha2[2];
      // Tile nb up to its P2 (in tOrP2, P2.V not yet issued), O1 and O2 rescaled for it.
      auto up_to_p2 = [&](int nb) {
        issue_qk(acc_s, tSrQ, tSrK, state.index());
        issue_qk(acc_s2, tSrQ2, tSrK2, state.index());
        const KeyBits keys = tile_keys(nb);
        warpgroup_wait<1>();  // S1 landed (and P2.V of tile nb-1); S2 may run
        warpgroup_fence_operand(acc_s);
        warpgroup_fence_operand(acc_o2);
        warpgroup_fence_operand(tOrP2);
        if (nb > 0) pipeline.consumer_release(last_stage);
        softmax(acc_s, nb, keys, alpha, 0);
        warpgroup_wait<0>();  // S2 landed
        warpgroup_fence_operand(acc_s2);
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(tOrP);
        rescale_o(acc_o, alpha);
        convert_p(acc_s, tOrP);
        issue_pv(tOrP, acc_o, state.index());
        softmax(acc_s2, nb, keys, alpha2, 1);  // while P1.V runs
        warpgroup_wait<0>();             // P1.V done
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(tOrP);
        rescale_o(acc_o2, alpha2);
        convert_p(acc_s2, tOrP2);
      };
      if (n_end > 0) {
        pipeline.consumer_wait(state);
        up_to_p2(0);
        for (int nb = 1; nb < n_end; ++nb) {
          last_stage = state;
          ++state;
          issue_pv(tOrP2, acc_o2, last_stage.index());  // O2 += P2 V of tile nb-1
          if constexpr (!kP2BesideNextS) {
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_o2);
            warpgroup_fence_operand(tOrP2);
          }
          pipeline.consumer_wait(state);
          up_to_p2(nb);
        }
        issue_pv(tOrP2, acc_o2, state.index());
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o2);
        pipeline.consumer_release(state);
        ++state;
      }
      next_stage = state;
    } else {
      QBarrier::wait(&storage.q_loaded, iter & 1);
      if constexpr (INT8) q_scale = quantise_q();
#if DIFFX_SM90_OVERLAP
      // FA3's intra-warpgroup overlap: S of tile nb is issued, then P.V of tile nb-1, so the softmax of
      // tile nb runs while P.V of tile nb-1 occupies the tensor cores. Tile nb-1's stage is released
      // once its P.V is done: the consumer holds two stages, hence kStages >= 3.
      // Ping-pong: barrier kTurnBarrier + map completes when this consumer waits on it and the other
      // has passed the turn (map 0 starts with it), so their issues alternate: map 0, map 1, map 0...
      // Each consumer issues n_end times; map 0 waits once more at the end for map 1's last pass, so
      // that every arrival is consumed before the epilogue.
      constexpr uint32_t kConsumerThreads = 2 * cutlass::NumThreadsPerWarpGroup;
      auto wait_turn = [&] {
        if constexpr (DIFFX_SM90_PINGPONG) cutlass::arch::NamedBarrier::sync(kConsumerThreads, kTurnBarrier + map);
      };
      auto pass_turn = [&] {
        if constexpr (DIFFX_SM90_PINGPONG) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, kTurnBarrier + 1 - map);
      };
      if (n_end > 0) {
        if (DIFFX_SM90_PINGPONG && map == 0) cutlass::arch::NamedBarrier::arrive(kConsumerThreads, kTurnBarrier);
        pipeline.consumer_wait(state);
        wait_turn();
        issue_s(state.index(), 0);
        pass_turn();
        KeyBits keys = tile_keys(0);
        warpgroup_wait<0>();
        land_s();
        softmax(acc_s, 0, keys, alpha, 0);  // O is zero: nothing to rescale
        convert_p(acc_s, tOrP);
        for (int nb = 1; nb < n_end; ++nb) {
          const auto previous = state;
          ++state;
          pipeline.consumer_wait(state);
          wait_turn();
          issue_s(state.index(), nb);               // S of tile nb (P of tile nb-1 is in tOrP already)
          issue_pv(tOrP, acc_o, previous.index());  // O += P V of tile nb-1
          pass_turn();
          keys = tile_keys(nb);
          warpgroup_wait<1>();                      // S landed; P.V may still run
          land_s();
          softmax(acc_s, nb, keys, alpha, 0);
          warpgroup_wait<0>();                      // P.V of tile nb-1 done: tOrP and its stage are free
          warpgroup_fence_operand(acc_o);
          warpgroup_fence_operand(tOrP);
          pipeline.consumer_release(previous);
          rescale_o(acc_o, alpha);
          convert_p(acc_s, tOrP);
        }
        wait_turn();
        issue_pv(tOrP, acc_o, state.index());
        pass_turn();
        if (map == 0) wait_turn();  // map 1's last pass
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        pipeline.consumer_release(state);
      }
      // The stage after this tile's last.
      next_stage = state;
      if (n_end > 0) ++next_stage;
#else
      // One tile at a time: S, softmax, P.V, each waited for before the next.
      for (int nb = 0; nb < n_end; ++nb) {
        pipeline.consumer_wait(state);
        issue_s(state.index(), nb);
        const KeyBits keys = tile_keys(nb);
        warpgroup_wait<0>();
        land_s();
        softmax(acc_s, nb, keys, alpha, 0);
        rescale_o(acc_o, alpha);
        convert_p(acc_s, tOrP);
        issue_pv(tOrP, acc_o, state.index());
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        pipeline.consumer_release(state);
        ++state;
      }
      next_stage = state;  // the loop has stepped past this tile's last stage
#endif
    }
    // Persistent: every wgmma of this tile has completed, so Q (and INT8's codes) may be replaced.
    if constexpr (kPersistent) cutlass::arch::ClusterBarrier::arrive(&storage.persistent.q_free);

    // Epilogue: out = norm(O1/l1 - lambda * O2/l2) * weight * output_scale (acc_o index c + 2r + 4j).
    // 1 / l of each row of slot `slot`'s map (0 for a row without a visible key).
    auto inverse_sums = [&](int slot, float (&inv_l)[2]) {
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[slot][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        inv_l[r] = l > 0.f ? 1.f / l : 0.f;
      }
    };
    float inv_l[2];
    inverse_sums(0, inv_l);
    // Writes the output rows of this thread from O1 (acc_o, scaled by inv_l) and O2 / l2, which
    // o2_over_l(r, j) gives for row acc_row(tid, 2r) at columns acc_col(tid, 4j) and the next.
    auto write_output = [&](auto&& o2_over_l) {
      const Element* lambda = static_cast<const Element*>(p.lambda_full);
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int qi = m_start + row_block * kBlockM + acc_row(tid, 2 * r);
        float lam = 0.f;
        if constexpr (Cfg::kV1) {
          lam = to_f(lambda[0]);
        } else if (qi < p.q_len) {
          lam = to_f(lambda[b * p.lambda_batch_stride + int64_t(qi) * p.lambda_row_stride + h * p.lambda_head_stride]);
        }
        float sumsq = 0.f;
        CUTE_UNROLL
        for (int j = 0; j < DV / 8; ++j) {
          const float2 o2 = o2_over_l(r, j);
          const float o0 = acc_o(4 * j + 2 * r) * inv_l[r] - lam * o2.x;
          const float o1 = acc_o(4 * j + 2 * r + 1) * inv_l[r] - lam * o2.y;
          acc_o(4 * j + 2 * r) = o0;
          acc_o(4 * j + 2 * r + 1) = o1;
          sumsq += o0 * o0 + o1 * o1;
        }
        sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 1);
        sumsq += __shfl_xor_sync(0xffffffffu, sumsq, 2);
        const float rms = p.norm ? rsqrtf(sumsq / float(DV) + p.norm_eps) : 1.f;
        if (qi < p.q_len) {
          Element* out = static_cast<Element*>(p.output) + b * p.o_batch_stride + int64_t(qi) * p.o_row_stride + h * DV;
          CUTE_UNROLL
          for (int j = 0; j < DV / 8; ++j) {  // two adjacent channels a store (the contract's strides are multiples of 8)
            const int col = acc_col(tid, 4 * j);
            alignas(4) Element pair[2] = {Element(acc_o(4 * j + 2 * r) * rms * p.norm_weight[col] * p.output_scale),
                                          Element(acc_o(4 * j + 2 * r + 1) * rms * p.norm_weight[col + 1] * p.output_scale)};
            *reinterpret_cast<uint32_t*>(out + col) = *reinterpret_cast<const uint32_t*>(pair);
          }
        }
      }
    };
    if constexpr (kBothMaps) {  // O2 is this thread's too
      float inv_l2[2];
      inverse_sums(1, inv_l2);
      write_output([&](int r, int j) {
        return make_float2(acc_o2(4 * j + 2 * r) * inv_l2[r], acc_o2(4 * j + 2 * r + 1) * inv_l2[r]);
      });
      continue;
    }
    // Both consumers are past their last wgmma and (one tile a CTA) the producer issued nothing more:
    // the ring's space becomes the scratch. Persistent, the scratch is its own (the producer is
    // refilling the ring), and this barrier keeps map 2 from overwriting it before map 1 has read the
    // last tile's.
    cutlass::arch::NamedBarrier::sync(2 * cutlass::NumThreadsPerWarpGroup, kEpilogueBarrier);
    float* scratch = [&] {
      if constexpr (kPersistent) return storage.persistent.scratch;
      else return storage.scratch;
    }();
    if (map == 1) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_o); i += 2) {
        const int r = (i >> 1) & 1, row = acc_row(tid, i), col = acc_col(tid, i);
        *reinterpret_cast<float2*>(scratch + row * Cfg::kScratchStride + col) =
            make_float2(acc_o(i) * inv_l[r], acc_o(i + 1) * inv_l[r]);
      }
    }
    cutlass::arch::NamedBarrier::sync(2 * cutlass::NumThreadsPerWarpGroup, kEpilogueBarrier);
    if (map != 0) continue;  // map 2: on to the next tile
    write_output([&](int r, int j) {
      return *reinterpret_cast<const float2*>(scratch + acc_row(tid, 2 * r) * Cfg::kScratchStride + acc_col(tid, 4 * j));
    });
  }
}

template <typename Element, int D, int DV, bool INT8>
cudaError_t launch(const KernelArgs& args, cudaStream_t stream) {
  using Cfg = Config<Element, D, DV, INT8>;
  const DiffxAttentionParams& p = args.p;
  Params<Element, D, DV, INT8> prm;
  prm.args = args;
  const int key_maps = Cfg::kV1 ? 2 * p.num_kv_heads : p.num_kv_heads;
  prm.shape_q = make_shape(p.q_len, int32_t(D), 2 * p.num_heads, p.batch);
  // INT8: K is the pre-pass's codes, [batch * key_maps, kv_pad, D] int8 in the workspace.
  prm.shape_k = make_shape(INT8 ? args.kv_pad : p.kv_len, int32_t(D), key_maps, p.batch);
  prm.shape_v = make_shape(p.kv_len, int32_t(DV), p.num_kv_heads, p.batch);
  // A batch of one may carry any batch stride (0 included); TMA descriptors need a non-zero one.
  auto batch_stride = [&](int64_t stride, int64_t rows, int64_t row_stride) {
    return p.batch == 1 ? rows * row_stride : stride;
  };
  auto q = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.query)), prm.shape_q,
                       make_stride(p.q_row_stride, _1{}, int64_t(D), batch_stride(p.q_batch_stride, p.q_len, p.q_row_stride)));
  auto k = [&] {
    if constexpr (INT8)
      return make_tensor(make_gmem_ptr(args.k_codes), prm.shape_k,
                         make_stride(int64_t(D), _1{}, int64_t(args.kv_pad) * D, int64_t(key_maps) * args.kv_pad * D));
    else
      return make_tensor(make_gmem_ptr(static_cast<const Element*>(p.key)), prm.shape_k,
                         make_stride(p.k_row_stride, _1{}, int64_t(D), batch_stride(p.k_batch_stride, p.kv_len, p.k_row_stride)));
  }();
  auto v = make_tensor(make_gmem_ptr(static_cast<const Element*>(p.value)), prm.shape_v,
                       make_stride(p.v_row_stride, _1{}, int64_t(DV), batch_stride(p.v_batch_stride, p.kv_len, p.v_row_stride)));
  prm.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, typename Cfg::SmemLayoutQ{});
  prm.tma_k = make_tma_copy(TmaLoadKV{}, k, take<0, 2>(typename Cfg::SmemLayoutK{}), Int<kClusterM>{});
  prm.tma_v = make_tma_copy(TmaLoadKV{}, v, take<0, 2>(typename Cfg::SmemLayoutV{}), Int<kClusterM>{});
  const auto kernel = diff_attention_sm90_kernel<Element, D, DV, INT8>;
  const int smem = int(sizeof(typename Cfg::SharedStorage));
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int m_blocks = (p.q_len + Cfg::kBlockRows - 1) / Cfg::kBlockRows;
  dim3 grid(unsigned((m_blocks + kClusterM - 1) / kClusterM * kClusterM), unsigned(p.num_heads), unsigned(p.batch));
  if constexpr (Cfg::kPersistent) {  // one CTA a streaming multiprocessor (or a tile, if fewer)
    int device = 0, sms = 0;
    if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
    if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
    grid = dim3(unsigned(std::min<int64_t>(int64_t(m_blocks) * p.num_heads * p.batch, sms)));
  }
  if constexpr (kClusterM == 1) {
    kernel<<<grid, kThreads, smem, stream>>>(prm);
    return cudaGetLastError();
  } else {
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kClusterM;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = size_t(smem);
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, prm);
  }
}

}  // namespace diffx::sm90

namespace diffx {

// The C ABI's element types to CUTLASS's; one generated translation unit per instantiation (CMake).
template <typename T, int D, int DV, bool INT8>
cudaError_t launch_diff_attention_sm90(const KernelArgs& args, cudaStream_t stream) {
  using Element = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cutlass::bfloat16_t, cutlass::half_t>;
  return sm90::launch<Element, D, DV, INT8>(args, stream);
}

}  // namespace diffx
