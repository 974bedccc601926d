// The Hopper path's tile configuration: MMA atoms, shared-memory layouts, TMA types and the shared
// storage of diff_attention_sm90.cu, in a header of its own so that hopper/layout_check.cu can
// check on the host (no GPU) the layout facts the kernel's index arithmetic relies on.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "../diff_attention.h"

namespace diffx::sm90 {

using namespace cute;

constexpr int kBlockM = DIFFX_QUERY_BLOCK;
constexpr int kThreads = 3 * cutlass::NumThreadsPerWarpGroup;
constexpr float kLog2e = 1.4426950408889634f;
constexpr uint32_t kEpilogueBarrier = 1;  // named barrier of the two consumer warpgroups (0 is __syncthreads)
constexpr uint32_t kQuantBarrier = 2;     // INT8: 2 + map, one consumer warpgroup's own barrier
constexpr uint32_t kTurnBarrier = 4;      // ping-pong: 4 + map, "consumer map may issue its wgmmas"
constexpr int kMaxDynamicSmem = 227 * 1024;  // sm_90's opt-in limit per block
// Registers a thread after setmaxnreg: the producer warpgroup gives some back, the two consumers
// take them (FA3's 24 / 240). setmaxnreg.inc draws on the CTA's pool, which is what the launch
// allocated (the kernel's register count, at most 64K / 384 threads rounded down to 8: 168), and
// waits until the pool holds enough: a split asking for more than the pool hangs the kernel (as
// 32 / 240 did in the cluster variant on an H200, 2026-11-28).
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;
constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
static_assert(cutlass::NumThreadsPerWarpGroup * (kProducerRegisters + 2 * kConsumerRegisters) <= kThreads * kLaunchRegisters,
              "the warpgroups' registers after setmaxnreg must fit the pool the launch allocated");

// 1 (default): each consumer issues S of tile j+1 before P.V of tile j and runs tile j+1's softmax
// while that P.V is on the tensor cores (FA3's intra-warpgroup overlap). 0: one tile at a time
// (the GPU campaign times it as a variant: -DDIFFX_SM90_OVERLAP=0).
#ifndef DIFFX_SM90_OVERLAP
#define DIFFX_SM90_OVERLAP 1
#endif
// 1 (with the overlap): the two consumers take turns to issue their wgmmas (FA3's ping-pong), so
// one warpgroup's softmax runs while the other's GEMMs hold the tensor cores. 0 (default): each
// issues when ready. On an H200 (2026-11-26, docs/BENCHMARKS.md) turns measured 0.95-1.11x
// (median 0.99x) against issuing when ready: kept as a variant (-DDIFFX_SM90_PINGPONG=1), not on.
// 1 (default): a consumer warp skips the O rescale of a tile where none of its rows' maxima grew
// (bit-identical output). 0: every tile rescales (the GPU campaign can time it as a variant:
// -DDIFFX_SM90_LAZY_RESCALE=0).
#ifndef DIFFX_SM90_LAZY_RESCALE
#define DIFFX_SM90_LAZY_RESCALE 1
#endif
// N > 0: a row's running max moves only when a tile's max exceeds it by more than N in log2 units
// (FlashAttention-4's rescale threshold; P < 2^N, fp16/bf16 hold it for N <= 15). 8 (default since
// 2026-11-28): on an H200 (2026-11-27, docs/BENCHMARKS.md) 0.95-1.00x the time of the exact max
// (median 0.97x) with the GPU suite passing on it. 0: the exact running max, the mma.sync kernel's
// arithmetic (-DDIFFX_SM90_RESCALE_SLACK=0).
#ifndef DIFFX_SM90_RESCALE_SLACK
#define DIFFX_SM90_RESCALE_SLACK 8
#endif
static_assert(DIFFX_SM90_RESCALE_SLACK >= 0 && DIFFX_SM90_RESCALE_SLACK <= 15, "P = 2^slack must stay well inside fp16");
#ifndef DIFFX_SM90_PINGPONG
#define DIFFX_SM90_PINGPONG 0
#endif
// 2: CTAs of two adjacent query blocks of one head form a cluster and share each K/V tile, each
// loading half of it by TMA multicast into both CTAs' rings: half the L2-to-SM traffic per flop
// (a 64-row CTA reads K1, K2 and V for 64 query rows; at 16k keys the path moves about 5 TB/s out
// of L2). 1 (default): one CTA loads its own tiles. A variant (-DDIFFX_SM90_CLUSTER_M=2): it hung on
// an H200 on 2026-11-28 (kProducerRegisters above), not yet timed.
#ifndef DIFFX_SM90_CLUSTER_M
#define DIFFX_SM90_CLUSTER_M 1
#endif
// 128 (default since 2026-11-28): tiles of 128 keys where three K/V stages of them still fit beside
// Q (every shape but V1 at head dim 128) and the logits are fp (the INT8 pre-pass scales tiles of
// DIFFX_KEY_BLOCK keys): half the barrier waits, row-max shuffles and rescale decisions per key,
// FA3's tile width. On an H200 (2026-11-28, docs/BENCHMARKS.md) V1 at d = 64, the one V1 shape it
// changes, took 0.91-1.01x the time of 64-key tiles (median 0.97x; 0.91-0.98x in the non-causal cases),
// while V1 at d = 128, the same code in both builds, read 0.99-1.09x in that loop. V2 is untimed
// (its probes pass). 64: DIFFX_KEY_BLOCK everywhere (-DDIFFX_SM90_KEY_BLOCK=64).
#ifndef DIFFX_SM90_KEY_BLOCK
#define DIFFX_SM90_KEY_BLOCK 128
#endif
static_assert(DIFFX_SM90_KEY_BLOCK == DIFFX_KEY_BLOCK || DIFFX_SM90_KEY_BLOCK == 128, "64 or 128 keys a tile");
// 1: a persistent grid, one CTA per SM working through the tiles (query block, head, batch) of the
// launch in turn, so that the producer loads the next tile's Q and K/V while the consumers finish
// the last one (its final P.V and epilogue): FA3's persistent scheduler, statically strided. Only
// where the epilogue's scratch fits beside the ring (V2, and V1 at d = 64; V1 at d = 128 keeps one
// tile a CTA). 0 (default): one tile a CTA. A variant (-DDIFFX_SM90_PERSISTENT=1): on an H200
// (2026-11-28) 0.99-1.12x the default's time at 16k (median 1.02x), no gain.
#ifndef DIFFX_SM90_PERSISTENT
#define DIFFX_SM90_PERSISTENT 0
#endif
static_assert(!(DIFFX_SM90_PERSISTENT && DIFFX_SM90_CLUSTER_M > 1), "a persistent grid of clusters is not built");
// K > 0: one in K of each softmax row's column pairs (8-key groups j with j % K == K - 1) takes its
// exponentials from hopper/exp2_fma.h (FMA and integer pipes, relative error 2.7e-6) instead of
// MUFU.EX2, FlashAttention-4's offload: at d = 64 a V1 tile's 4096 exponentials a map take 2/3 of
// its tensor time on MUFU's 16 a clock (1/3 at d = 128); K = 4 moves a quarter of them. 0 (default):
// every exponential on MUFU. A variant (-DDIFFX_SM90_EXP2_FMA_EVERY=4): on an H200 (2026-11-28)
// 1.04-1.11x the default's time at 16k (median 1.08x), slower.
#ifndef DIFFX_SM90_EXP2_FMA_EVERY
#define DIFFX_SM90_EXP2_FMA_EVERY 0
#endif
static_assert(DIFFX_SM90_EXP2_FMA_EVERY >= 0 && DIFFX_SM90_EXP2_FMA_EVERY <= 8, "one in 1..8 column pairs, or none");
// 2: each consumer warpgroup runs both maps for its own 64 query rows, and a CTA takes 128 rows
// (two such warpgroups), where the registers allow it: fp logits, head dim 64 (O1 and O2 take 128
// of a thread's 240 at V1's DV = 128) and 64-key tiles (S1 and S2 another 64). Within a warpgroup S2's
// wgmma is issued with S1's, so softmax(S1) runs while S2 is on the tensor cores and softmax(S2)
// while P1.V is (FlashAttention-3's inter-GEMM overlap, which one map a warpgroup cannot have),
// each K/V stage serves 128 query rows instead of 64 (the cluster variant's halving of the
// L2-to-SM traffic, without a cluster), and the epilogue finds O1 and O2 in the same thread (no
// scratch, no barrier). Elsewhere (head dim 128, INT8 logits) the kernel is the default one.
// 1 (default): one map a consumer warpgroup, 64 query rows a CTA. A variant
// (-DDIFFX_SM90_MAPS_PER_WARPGROUP=2), not yet run on a GPU.
#ifndef DIFFX_SM90_MAPS_PER_WARPGROUP
#define DIFFX_SM90_MAPS_PER_WARPGROUP 1
#endif
static_assert(DIFFX_SM90_MAPS_PER_WARPGROUP == 1 || DIFFX_SM90_MAPS_PER_WARPGROUP == 2, "one map or both a warpgroup");
static_assert(DIFFX_SM90_MAPS_PER_WARPGROUP == 1 || (!DIFFX_SM90_PERSISTENT && DIFFX_SM90_CLUSTER_M == 1),
              "both maps a warpgroup is built without a persistent grid or clusters");
static_assert(DIFFX_SM90_CLUSTER_M == 1 || DIFFX_SM90_CLUSTER_M == 2, "a cluster of 1 or 2 query blocks");
constexpr int kClusterM = DIFFX_SM90_CLUSTER_M;
using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
// K and V tiles: multicast when the cluster shares them (the atom takes the mask either way).
using TmaLoadKV = std::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;

// Row and column of value i of consumer thread tid (0..127) in a 64 x N wgmma accumulator (S, and
// O of DV columns): the mma.sync m16n8 layout repeated, value index c + 2r + 4j for row +8r and
// column 8j + 2(tid % 4) + c. The kernel's masks and epilogue index the accumulator with these;
// layout_check.cu compares them with CuTe's own partition of the accumulator.
CUTE_HOST_DEVICE constexpr int acc_row(int tid, int i) { return (tid >> 5) * 16 + ((tid & 31) >> 2) + ((i >> 1) & 1) * 8; }
CUTE_HOST_DEVICE constexpr int acc_col(int tid, int i) { return (i >> 2) * 8 + (tid & 3) * 2 + (i & 1); }
// The key masks' bits (key_flags.cuh: bit j, key j of the tile), shifted right once a tile by
// acc_key_shift(tid), hold value i's key at bit acc_col(0, i), known at compile time per value.
CUTE_HOST_DEVICE constexpr int acc_key_shift(int tid) { return acc_col(tid, 0) - acc_col(0, 0); }

// MAPS_PER_WARPGROUP: DIFFX_SM90_MAPS_PER_WARPGROUP, a parameter so that layout_check.cu checks
// both configurations in one compile.
template <typename Element, int D, int DV, bool INT8 = false, int MAPS_PER_WARPGROUP = DIFFX_SM90_MAPS_PER_WARPGROUP>
struct Config {
  static constexpr bool kV1 = DV == 2 * D;
  static constexpr int kKeyMaps = kV1 ? 2 : 1;
  // Both maps in each consumer warpgroup (above), where its registers hold O1, O2, S1, S2, P1, P2
  // and the wgmma descriptors without spilling (V2 at d = 128 spills 32 bytes: D = 64 only).
  static constexpr bool kBothMaps = MAPS_PER_WARPGROUP == 2 && !INT8 && D == 64;
  static constexpr int kRowBlocks = kBothMaps ? 2 : 1;   // 64-row query blocks a CTA: one a consumer
  static constexpr int kBlockRows = kRowBlocks * kBlockM;  // query rows a CTA
  static constexpr int kQTiles = 2 * kRowBlocks;           // 64 x D tiles of Q in shared memory: (row block, map)
  // INT8 logits: K arrives as the pre-pass's int8 codes (quantize_keys.cuh), each consumer turns
  // its Q map into codes in shared memory, and S = Q8 K8^T runs on s8 wgmma (int32 accumulator,
  // the fp32 one's layout). P.V stays fp16/bf16.
  using KElement = std::conditional_t<INT8, int8_t, Element>;
  using AccumulatorS = std::conditional_t<INT8, int32_t, float>;
  static constexpr int kQCodeBytes = INT8 ? 2 * kBlockM * D : 0;
  static constexpr int kQBytesAll = kQTiles * kBlockM * D * int(sizeof(Element)) + kQCodeBytes;
  static constexpr int stages_of(int keys) {
    return (kMaxDynamicSmem - kQBytesAll - 1024) / (kKeyMaps * keys * D * int(sizeof(KElement)) + keys * DV * int(sizeof(Element)));
  }
  static constexpr bool kWideKeys = DIFFX_SM90_KEY_BLOCK == 128 && !INT8 && !kBothMaps && stages_of(128) >= 3;
  static constexpr int kKeyBlock = kWideKeys ? 128 : DIFFX_KEY_BLOCK;  // keys a tile
  using KeyBlock = Int<kKeyBlock>;
  // As many K/V stages as sm_90's shared memory holds beside Q (at most 4): with 64-key tiles 3 for
  // V1 at head dim 128, 4 otherwise; with 128-key tiles 3 (V2 at d = 64: 4). The overlapped consumer (DIFFX_SM90_OVERLAP) holds two stages at a time, so
  // with two the producer could refill none while it computes.
  static constexpr int kStages = cute::min(4, stages_of(kKeyBlock));
  static_assert(kStages >= 3, "the overlapped consumer needs three K/V stages");
  static constexpr int kScratchStride = DV + 8;  // floats; see TileConfig::kScratchStride
  static constexpr int kScratchBytes = kBlockM * kScratchStride * int(sizeof(float));
  // Persistent where the epilogue's own scratch fits beside Q and the ring (1 KB of barriers and
  // 1 KB of alignment spare), since the ring is then refilled while the epilogue runs.
  static constexpr bool kPersistent =
      DIFFX_SM90_PERSISTENT && kQBytesAll + kStages * (kKeyMaps * kKeyBlock * D * int(sizeof(KElement)) +
                                                       kKeyBlock * DV * int(sizeof(Element))) +
                                       kScratchBytes + 2048 <= kMaxDynamicSmem;

  using TiledMmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<KElement, KElement, AccumulatorS, Shape<_64, KeyBlock, Int<D>>>()));
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<DV>, KeyBlock>, GMMA::Major::K, GMMA::Major::MN>()));

  using AtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, _64, Int<D>>());
  using AtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, KElement, KeyBlock, Int<D>>());
  using SmemLayoutQ = decltype(tile_to_shape(AtomQ{}, Shape<_64, Int<D>>{}));
  using SmemLayoutQCodes = decltype(tile_to_shape(AtomK{}, Shape<_64, Int<D>>{}));  // INT8: Q's codes, S's A operand
  using SmemLayoutK = decltype(tile_to_shape(AtomK{}, Shape<KeyBlock, Int<D>, Int<kStages>>{}));
  // V lands as [keys, DV] rows (the global layout); P.V reads it transposed, DV-major, as wgmma's B.
  using AtomV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, KeyBlock, Int<DV>>());
  using SmemLayoutV = decltype(tile_to_shape(AtomV{}, Shape<KeyBlock, Int<DV>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<DV>, KeyBlock, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // Global views (rows, columns, head, batch) with the contract's free row and batch strides.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemShape{}, GmemStride{}));
  using GmemTensorK = decltype(make_tensor(make_gmem_ptr(static_cast<KElement const*>(nullptr)), GmemShape{}, GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}));
  using TmaK = decltype(make_tma_copy(TmaLoadKV{}, GmemTensorK{}, take<0, 2>(SmemLayoutK{}), Int<kClusterM>{}));
  using TmaV = decltype(make_tma_copy(TmaLoadKV{}, GmemTensor{}, take<0, 2>(SmemLayoutV{}), Int<kClusterM>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kQBytes = kQTiles * cosize_v<SmemLayoutQ> * sizeof(Element);
  // What lands in each CTA's stage (with a cluster of 2, half of it from the other CTA's loads).
  static constexpr uint32_t kStageBytes =
      kKeyMaps * size(take<0, 2>(SmemLayoutK{})) * sizeof(KElement) + size(take<0, 2>(SmemLayoutV{})) * sizeof(Element);

  struct QCodes {
    cute::array_aligned<int8_t, cosize_v<SmemLayoutQCodes>, 1024> q[2];
  };
  struct NoQCodes {};
  struct PersistentParts {
    float scratch[kBlockM * kScratchStride];  // the epilogue's O2 / l2, apart from the ring being refilled
    uint64_t q_free;                          // mbarrier: both consumers are done with this tile's Q
  };
  struct NoPersistentParts {};
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q[kQTiles];  // Q of (row block, map) at 2 * block + map
    union {
      struct {
        cute::array_aligned<KElement, cosize_v<SmemLayoutK>, 1024> k[kKeyMaps];
        cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
      } ring;
      float scratch[kBlockM * kScratchStride];  // epilogue: O2 / l2 of the 64 rows
    };
    typename Pipeline::SharedStorage pipeline;
    uint64_t q_loaded;      // mbarrier: Q1 and Q2 landed
    float q_absmax[2][4];   // INT8: each consumer warp's largest |Q| of its map
    std::conditional_t<kPersistent, PersistentParts, NoPersistentParts> persistent;
    std::conditional_t<INT8, QCodes, NoQCodes> q_codes;  // last: nothing to align when empty
  };
  static_assert(sizeof(SharedStorage) <= kMaxDynamicSmem, "the Hopper tiles exceed sm_90's shared memory");
  // The epilogue's scratch reuses the ring: it must not be what sizes the union.
  static_assert(sizeof(float) * kBlockM * kScratchStride <= sizeof(SharedStorage::ring), "scratch outgrows the ring");
};

}  // namespace diffx::sm90
