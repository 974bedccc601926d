// The split-KV decode kernels (flash-decoding for differential attention): calls with at most
// DIFFX_DECODE_MAX_QUERY query tokens, where a 64-row query tile would be mostly padding and one
// CTA per (batch, diff-head) would leave most SMs idle while the whole cache streams through them.
//
// Kernel 1, one CTA per (group of diff-heads, batch element, key split), 8 warps: warps 0-3 run
// map 1 and warps 4-7 map 2 on the same 16-row query tile, and warp w of a map takes keys
// 16w..16w+15 of every 64-key tile of the split. The tile's rows are (head, query token) pairs:
// every query token of the call for each of the group's heads (GQA heads that share a kv group,
// as many as fit 16 rows; decode_plan chooses), zero-padded. Heads that share K/V thus read each
// tile once, where one CTA per head would read it once per head. Each warp keeps its own
// running max, sum and fp32 P.V accumulator for both of its rows-halves, exactly as the one-pass
// kernel's warps do. At the end the 4 warps of a map merge their states in shared memory (to the
// map's max, added in warp order: deterministic) and the CTA writes one partial state ("part") per
// map, unnormalised, to the workspace: 4x fewer bytes for kernel 2 to write and read than a part
// per warp (with 4 query tokens, those bytes cost 8 points of copy bandwidth at 32k keys on an
// H100, 2026-11-26).
// Every K/V tile is read from global memory once per CTA; V serves both maps. With two K/V stages
// (STAGES = 2: every head dim 64, and head dim 128 where the GPU's shared memory holds 136 KB) tile
// j+1 is requested before tile j is computed, so one CTA per SM keeps the DRAM busy; with one
// stage the next tile is requested only once this one's K (then V) has been read, and its latency
// shows once per tile (the 77% of copy bandwidth measured on an H200 on 2026-11-26 at d=128).
//
// Kernel 2, one CTA per (diff-head, batch element, query token): rescales the parts of each map to
// their common max, sums them side by side (the CTA's threads share the parts), divides by the
// summed softmax denominators, and applies the epilogue of the one-pass kernel:
// norm(O1/l1 - lambda * O2/l2) * weight * output_scale.
//
// The key/value layout is the op contract's (the KV-cache export feeds the whole cache, past and
// new tokens, as `key`/`value`; batch and row strides let a preallocated cache be read in place).
// Causal masks align bottom-right, key_mask hides padding keys, a row that sees no key gives zeros.
#pragma once

#include <float.h>
#include <math.h>

#include <type_traits>

#include "diff_attention_fwd.cuh"
#include "kv_codes.cuh"

namespace diffx {

constexpr int kDecodeRows = DIFFX_DECODE_MAX_QUERY;  // query rows of the tile (one mma M)
static_assert(kDecodeRows == 16, "one m16n8k16 row block");
static_assert(kDecodeWarpsPerMap == kWarpsPerMap && kDecodeWarpsPerMap * 16 == kBlockN, "16 keys a warp");

// K/V stages of the 8-bit-cache decode kernel where the GPU's shared memory holds them (else 2):
// its tiles are half as large, so more of them can be in flight per SM.
#ifndef DIFFX_DECODE_KV_STAGES
#define DIFFX_DECODE_KV_STAGES 3
#endif

// DIFFX_DECODE_KV_TILES (64-key tiles a step): kernel_args.h, since the plan reads it too.

// 1: on sm_90 and later the merge kernel is launched as a programmatic dependent of the split kernel
// (FlashAttention-3 launches its split-KV combine so): it launches once every split CTA has started,
// its CTAs take the SMs the last splits free and wait there (griddepcontrol.wait) for the split
// kernel's end, so its launch and start-up overlap the splits' tail instead of following it. A decode
// call is two kernels of a few to a few hundred microseconds each; that gap is a part of the short ones.
#ifndef DIFFX_DECODE_PDL
#define DIFFX_DECODE_PDL 1
#endif

// 1: with two tiles a step, a call whose group rows (heads x query tokens) fit 8 puts both maps in
// one row tile: map 1's rows in rows 0-7, map 2's in 8-15 (a lane's mma fragment holds one row of
// each half). Every warp then takes 16 keys of its own (warps 0-3 the step's first tile, 4-7 its
// second) for both maps: the V codes are converted once where the maps' warps each converted them,
// and one P.V serves both maps; Q.K takes an mma per map's keys (V1: K1 and K2) and keeps each
// half's rows. 0 (default until a GPU has timed it): each map its own 16-row tile and warps.
#ifndef DIFFX_DECODE_KV_PACK_MAPS
#define DIFFX_DECODE_KV_PACK_MAPS 0
#endif

// Barriers a step of the decode loop in three or more stages (the 8-bit cache's). 1: the step's one
// barrier, after its tiles have landed, also says every warp has left the step before, whose stage
// is refilled just after it. 2 (the loop until 2026-11-29): the refill is issued before the wait,
// so a second barrier at the step's end keeps it off a stage another warp may still read. Both keep
// STAGES - 1 steps in flight while a step is computed and 1 meets its warps once a step instead of
// twice; while a step waits for its tiles, 1 has one step less in flight. Two stages (the float
// cache's) keep 2: their one step in flight during the wait is what keeps DRAM busy there.
#ifndef DIFFX_DECODE_BARRIERS_A_STEP
#define DIFFX_DECODE_BARRIERS_A_STEP 1
#endif
static_assert(DIFFX_DECODE_BARRIERS_A_STEP == 1 || DIFFX_DECODE_BARRIERS_A_STEP == 2, "1 or 2 barriers a step");

// 1: the 8-bit cache's loop of three or more stages (one barrier a step) overlaps two steps in each
// warp, as FlashAttention-3 does within a warpgroup: step i + 1's Q.K^T is issued before step i's
// P.V, and its softmax runs beside that P.V. The key ring then leads the value ring by a step, so
// the same shared memory holds as many steps in flight. 0 (default until a GPU has timed it): each
// step's Q.K^T, softmax and P.V in turn, as two warps of an SM sub-partition (map 1's and map 2's
// of the same keys) also run them.
#ifndef DIFFX_DECODE_KV_OVERLAP
#define DIFFX_DECODE_KV_OVERLAP 0
#endif

// 1: in the 8-bit cache's loop of three or more stages, the warps that read a row copy it, and a
// step waits for those warps alone, not for the CTA. With packed maps (DIFFX_DECODE_KV_PACK_MAPS)
// every row a warp reads is its own (its 16 keys of its tile of the step: both maps' key codes and
// their values): it copies them, waits for its own copies (cp.async.wait_group, then __syncwarp)
// and meets no other warp until the end. Without, the two warps of a quarter (map 1's and map 2's
// of the same 16 keys) share their value rows (V2: their key rows too): each copies half of every
// tile's 16 rows, and the pair meets at a named barrier of its 64 threads. Map 2's warp of
// quarter q is then warp 4 + (q + 3) % 4, so that an SM sub-partition holds warps of two pairs.
// Either way the warps of a sub-partition may drift apart, one converting while the other
// exponentiates, and a step no longer waits for the CTA's slowest warp. The same shared memory,
// copies and steps in flight. 0 (default until a GPU has timed it): the CTA's threads copy whole
// tiles and meet at the step's barrier.
#ifndef DIFFX_DECODE_KV_WARP_COPIES
#define DIFFX_DECODE_KV_WARP_COPIES 0
#endif

// 1: on an int8 cache, Q.K^T runs on s8 mma (m16n8k32) straight on the key codes: each map's folded Q
// (K's scales folded in, as below) becomes int8 codes with one absmax scale a map's tile (the INT8
// logits recipe's, quantization.py "qk"), and a logit is that scale x the int32 sum. The key codes
// then need no conversion to fp16 (two PRMT a pair of codes), and a 32-channel k-step takes one mma
// and one Q ldmatrix a key n-tile where fp16 takes two of each: about 100 of the ~630 instructions
// a warp issues a step at V1 d = 128 (sm_90a SASS). The cost: Q rounded to 8 bits (emulated cosine
// against the float32 reference on the float cache 0.99986-0.99992; issue 62's budget is 0.999).
// The e4m3 cache keeps fp16 Q.K^T.
// 0 (default until a GPU has timed it): fp16 Q.K^T on converted codes.
#ifndef DIFFX_DECODE_KV_S8_QK
#define DIFFX_DECODE_KV_S8_QK 0
#endif

// A key-masked call's flags (int64, one a key). 1 (default, 2026-12-01; not yet run on a GPU): they
// travel with the keys. The threads that copy a step's key tiles copy its keys' flags by cp.async
// into shared memory beside them, and a warp reads its keys' flags from there (one LDS.64 a lane)
// for the ballot that makes them bits; a step whose keys are all present (and not cut by the causal
// diagonal) skips its masked block. No load from global memory is left in a step, none waits there,
// no register holds a flag across Q.K^T, and map 1's and map 2's warps no longer load the same flags
// each. 1 KB of shared memory a stage at two tiles a step. Every KV-cache decoder passes key_mask,
// so each of its decode steps is a masked one.
// 0 (the campaign's `maskloads`): each lane loads its keys' flags from global memory in the step:
// at head dim 128 before Q.K^T, whose mmas hide the load; at head dim 64 after it (held across it at
// the 128 registers of two CTAs an SM they spilled). Until 2026-12-01 head dim 64 loaded one flag per
// score element instead, 8 (float cache) or 16 (8-bit cache) dependent LDG.E.64 a thread a step.
#ifndef DIFFX_DECODE_STAGED_FLAGS
#define DIFFX_DECODE_STAGED_FLAGS 1
#endif

// An 8-bit cache's shared tiles (its code tiles and its folded fp16 Q): rows padded by 16 bytes
// instead of XOR-swizzled (DIFFX_DECODE_KV_ROW_PAD, default 16; 0 keeps the swizzle). The 8 rows
// of an ldmatrix phase still fall on 8 distinct 16-byte bank groups (a row of an odd number of
// chunks moves to the next group), and a chunk's offset is the row's plus a constant: each
// ldmatrix of a step is a base and an immediate, where the swizzle took two or three integer
// instructions an address (about 70 a step at V1 d = 128 on sm_90a: ptxas recomputed the lane's
// offsets from its index). V1's key tiles at D = 64 keep the swizzle: their padding (12 KB at three
// stages of two tiles) would leave no room for two CTAs an SM.
#ifndef DIFFX_DECODE_KV_ROW_PAD
#define DIFFX_DECODE_KV_ROW_PAD 16
#endif
static_assert(DIFFX_DECODE_KV_ROW_PAD == 0 || DIFFX_DECODE_KV_ROW_PAD == 16, "rows padded by 16 bytes or swizzled");
#if DIFFX_DECODE_KV_WARP_COPIES && DIFFX_DECODE_KV_ROW_PAD == 0
#error "DIFFX_DECODE_KV_WARP_COPIES=1 needs padded rows: a warp's copies of a swizzled tile would take one swizzle a copy"
#endif

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of ROW_BYTES rows padded by PAD
// (0: swizzled_chunk's XOR swizzle).
template <int ROW_BYTES, int PAD>
__device__ __forceinline__ int tile_chunk_offset(int row, int chunk) {
  static_assert(PAD == 0 || ((ROW_BYTES + PAD) / 16) % 2 == 1, "an odd number of chunks a row: conflict-free ldmatrix");
  if constexpr (PAD != 0) return row * (ROW_BYTES + PAD) + chunk * 16;
  else return swizzled_chunk<ROW_BYTES / 16>(row, chunk) * 16;
}

// KV: the cache's DiffxKvFormat (0: key and value in T; else 1-byte codes, kv_codes.cuh).
// KT: 64-key tiles a step (a stage holds KT tiles of each of K and V; 8-bit codes only).
template <typename T, int D, int DV, bool INT8, int STAGES, int KV = 0, int KT = 1>
struct DecodeTileConfig {
  using Fwd = TileConfig<T, D, DV, INT8>;
  static_assert(STAGES >= 1 && STAGES <= 4 && (KV == 0 || STAGES >= 2), "1-4 K/V stages, at least 2 for 8-bit codes");
  static_assert(!(INT8 && KV), "an 8-bit cache does not combine with INT8 logits");
  static_assert(KT == 1 || (KT == 2 && KV != 0), "two tiles a step only for 8-bit codes");
  // An 8-bit cache's rows padded (DIFFX_DECODE_KV_ROW_PAD): the folded Q's, the value codes', and the
  // key codes' but for V1 at D = 64.
  static constexpr int kQRowPad = KV ? DIFFX_DECODE_KV_ROW_PAD : 0;
  static constexpr int kKRowPad = KV && (D == 128 || !Fwd::kV1) ? DIFFX_DECODE_KV_ROW_PAD : 0;
  static constexpr int kVRowPad = KV ? DIFFX_DECODE_KV_ROW_PAD : 0;
  static constexpr int kQTileBytes = kDecodeRows * (D * int(sizeof(T)) + kQRowPad);
  static constexpr int kQ8TileBytes = INT8 ? kDecodeRows * D : 0;
  static constexpr int kKCodeTileBytes = kBlockN * (D + kKRowPad);   // an 8-bit cache: one 64-key tile of a key head
  static constexpr int kVCodeTileBytes = kBlockN * (DV + kVRowPad);  // ... and of the values
  static constexpr int kKTileBytes = KV ? KT * kKCodeTileBytes : Fwd::kKTileBytes;  // a map's KT key tiles
  static constexpr int kVTileBytes = KV ? KT * kVCodeTileBytes : Fwd::kVTileBytes;
  static constexpr int kStageBytes = Fwd::kKeyTiles * kKTileBytes + kVTileBytes;  // K tile(s) + V tile
  // A stage's key-mask flags (DIFFX_DECODE_STAGED_FLAGS): an int64 a key of its KT tiles, after the stages.
  static constexpr int kFlagBytes = DIFFX_DECODE_STAGED_FLAGS ? KT * kBlockN * int(sizeof(int64_t)) : 0;
  static constexpr int kSmemBytes = 2 * kQTileBytes + 2 * kQ8TileBytes + STAGES * (kStageBytes + kFlagBytes);
  // The fewest stages of one tile (one; two for 8-bit codes) launch everywhere (sm_86/sm_89 opt in
  // to 99 KB); the others need the GPU's opt-in checked at launch (decode_pipeline) unless they
  // fit that too. 227 KB: sm_90's opt-in.
  static_assert(STAGES > (KV ? 2 : 1) || KT > 1 || kSmemBytes <= kDynamicSmemLimit,
                "the decode tiles would not launch on sm_86/sm_89");
  static_assert(kSmemBytes <= 227 * 1024, "the decode tiles would not launch on any GPU");
  // D = 64 runs two CTAs an SM (DIFFX_DECODE_D64_MIN_BLOCKS): on sm_90 (228 KB an SM, 1 KB of it
  // reserved a CTA) up to three stages of its tiles, with the static budget, leave room for both.
  static_assert(D != 64 || STAGES > 3 || 2 * (kSmemBytes + kStaticSmemBudget + 1024) <= 228 * 1024, "two CTAs an SM on sm_90");
  static constexpr bool kFitsEverywhere = kSmemBytes <= kDynamicSmemLimit;
};

// Copies the rows of ROW_BYTES for which valid(row) holds (row r from src(r)) into a swizzled
// 16-row shared tile, the other rows zero-filled: the query rows of the packed heads, gathered from
// their columns of Q.
template <int ROW_BYTES, typename Valid, typename Src>
__device__ __forceinline__ void load_query_rows(char* smem, int tid, Valid valid_row, Src src) {
  constexpr int kChunks = ROW_BYTES / 16;
  for (int c = tid; c < kDecodeRows * kChunks; c += kThreads) {
    const int row = c / kChunks, chunk = c % kChunks;
    const bool valid = valid_row(row);
    cp_async_16(smem + swizzled_chunk<kChunks>(row, chunk) * 16, src(valid ? row : 0) + chunk * 16, valid);
  }
}

// Grid: x = group of heads_per_cta diff-heads, y = batch element, z = key split.
inline void decode_grid(const KernelArgs& args, unsigned (&dims)[3]) {
  dims[0] = unsigned(args.p.num_heads / args.plan.heads_per_cta);
  dims[1] = unsigned(args.p.batch);
  dims[2] = unsigned(args.plan.splits);
}

// Index of the first (row 0) partial state of (b, h, map, part).
__device__ __forceinline__ int64_t part_index(const KernelArgs& args, int b, int h, int map, int part) {
  return ((int64_t(b) * args.p.num_heads + h) * 2 + map) * args.decode_parts * args.p.q_len +
         int64_t(part) * args.p.q_len;
}

// The end of kernel 1: a map's 4 warp states merged in shared memory, rows padded so that a warp's
// accesses fall in distinct banks. A float cache's lane holds pairs of channels (float2, 8 rows x 4
// pairs a warp: 8 floats of padding, 2 wavefronts an access); an 8-bit cache's holds runs of four
// (float4 over two of its accumulator tiles, 8 rows x 4 runs: 16 floats, 4 wavefronts, the fewest
// for 512 bytes).
template <int DV, bool CODES>
constexpr int kMergeStride = DV + (CODES ? 16 : 8);
template <int DV, bool CODES>
constexpr int kMergeBufferBytes =
    (2 * kDecodeRows * kMergeStride<DV, CODES> + 2 * kWarpsPerMap * kDecodeRows * 2) * int(sizeof(float));

// DIFFX_DECODE_D64_MIN_BLOCKS (CTAs an SM at head dim 64): kernel_args.h, since the plan reads it too.

// The cp.async copies a thread issues for the code tiles of an 8-bit cache (kv_codes.cuh): rows of
// ROW_BYTES codes, 64 rows in shared memory laid out by tile_chunk_offset (rows padded by PAD, or
// swizzled like the INT8-logits key tiles), rows past kv_len zero-filled; HEADS tiles a key tile
// (V1's K1 and K2: heads ROW_BYTES apart in a cache row, tiles HEAD_TILE_BYTES apart in shared
// memory). Set up once a CTA, so a tile's copies are the first tile's moved by whole tiles;
// load_tile_async recomputes every address and predicate per tile (86 integer instructions a
// thread per tile of the V1 d = 128 kernel on sm_90a, against its 8 copies). THREADS threads copy
// ROWS rows of each tile from row `first` (DIFFX_DECODE_KV_WARP_COPIES: a warp its own 16), the
// thread of index `tid` among them.
template <int ROW_BYTES, int PAD, int HEADS = 1, int HEAD_TILE_BYTES = 0, int THREADS = kThreads, int ROWS = kBlockN>
struct CodeTileCopies {
  static constexpr int kChunks = ROW_BYTES / 16;
  static constexpr int kRowStep = THREADS / kChunks;  // rows apart of a thread's copies
  static constexpr int kCopies = ROWS / kRowStep;
  static constexpr int kTileRowSteps = kBlockN / kRowStep;  // a tile in row steps
  static constexpr int kPitch = ROW_BYTES + PAD;          // a row in shared memory
  static constexpr int kTileBytes = kBlockN * kPitch;     // a tile in shared memory
  static_assert(THREADS % kChunks == 0 && (PAD != 0 || kRowStep % 8 == 0) && ROWS % kRowStep == 0 &&
                    ROWS <= kBlockN,
                "fixed trip count, one swizzle per thread");
  static_assert(HEADS == 1 || HEAD_TILE_BYTES >= kTileBytes, "one tile a head");
  const char* src;    // this thread's chunk of row row0 of tile 0 (head 0)
  int64_t row_step;   // bytes from one of its copies to the next (kRowStep rows; a tile is kBlockN rows)
  int dst;            // byte offset of its first chunk in a shared tile
  int row0;

  __device__ __forceinline__ CodeTileCopies(const char* tile0, int64_t row_stride, int tid, int first = 0)
      : row_step(kRowStep * row_stride) {
    row0 = first + tid / kChunks;
    const int chunk = tid % kChunks;
    src = tile0 + row0 * row_stride + chunk * 16;
    dst = tile_chunk_offset<ROW_BYTES, PAD>(row0, chunk);
  }
  // Tile nb of head h into `tile`, whose first `rows` rows hold keys.
  __device__ __forceinline__ void issue(char* tile, int nb, int h, int rows) const {
    const char* from = src + h * ROW_BYTES + int64_t(nb) * kTileRowSteps * row_step;
    if (rows >= kBlockN) {
#pragma unroll
      for (int i = 0; i < kCopies; ++i) cp_async_16(tile + dst + i * kRowStep * kPitch, from + i * row_step, true);
    } else {
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const bool valid = row0 + i * kRowStep < rows;
        cp_async_16(tile + dst + i * kRowStep * kPitch, valid ? from + i * row_step : src, valid);
      }
    }
  }
  // Tiles nb .. nb + KT - 1 of every head, every row holding a key, into tiles[t] (head h at
  // tiles[t] + h * HEAD_TILE_BYTES): one base a step, one address a copy, a second head's the
  // first's plus an immediate (V1 d = 128 on sm_90a: 42 instructions beside the 16 copies, where
  // a tile's own base and a head's own addresses took 62).
  template <int KT>
  __device__ __forceinline__ void issue_full_step(char* const (&tiles)[KT], int nb) const {
    const char* base = src + uint64_t(uint32_t(nb)) * uint64_t(kTileRowSteps * row_step);  // (nb >= 0: no sign extension)
#pragma unroll
    for (int t = 0; t < KT; ++t)
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const char* from = base + (t * kTileRowSteps + i) * row_step;
#pragma unroll
        for (int h = 0; h < HEADS; ++h)
          cp_async_16(tiles[t] + h * HEAD_TILE_BYTES + dst + i * kRowStep * kPitch, from + h * ROW_BYTES, true);
      }
  }
};

// Q.K^T of an 8-bit cache runs on fp16 operands whatever T is: the codes become fp16 pairs in a
// few integer ops (kv_codes.cuh), where bf16 pairs would cost float arithmetic per code.
// Q's largest entry after the fold is kept at most this big (fp16's range is 65504).
constexpr float kFoldedQueryMax = 16384.f;

// An 8-bit cache: both maps' Q tiles (landed, swizzled, in T) rewritten in place as fp16. Each
// channel is multiplied by its key head's scale over kv_code_unit (K's scales folded into Q:
// S = sum_c (q_c s_c) code_c), and the channels of each 16-wide k-step are reordered to match the
// key fragments that ldmatrix reads from the code tiles: there a lane's register holds channels
// 4t..4t+3 of its key, so the Q position the mma pairs with channel pair (4t, 4t+1) is 2t and with
// (4t+2, 4t+3) it is 8 + 2t. Each map's folded Q is divided by the power of two alpha that puts its
// largest entry in [kFoldedQueryMax / 2, kFoldedQueryMax), returned per map; the logits are
// S * alpha, exactly. (Up as well as down: keys that barely vary get small scales, which would
// otherwise push Q into fp16's subnormals.) All threads call it (it synchronises); `reduce` holds
// a float per warp. PM (DIFFX_DECODE_KV_PACK_MAPS): both maps in the first tile, map m's row r at
// row 8m + r. Returns both maps' alpha. S8 (DIFFX_DECODE_KV_S8_QK, int8 codes): the tiles become
// int8 codes instead, rows of D bytes (tile_chunk_offset<D, PAD>) in channel order, code =
// rint(q / alpha) with alpha = the map's largest |q| / 127 (1 for an all-zero Q).
template <typename T, int D, bool V1, int KV, int PAD, bool PM = false, bool S8 = false>
__device__ __forceinline__ float2 fold_key_scales_into_query(char* sQ, int q_tile_bytes, const KernelArgs& args, int g,
                                                             float* reduce, int tid) {
  constexpr int kRows = PM ? kDecodeRows / 2 : kDecodeRows;  // rows a map holds
  constexpr int kChunks = D / 8, kGroups = D / 16, kItems = 2 * kRows * kGroups;
  static_assert(kItems <= kThreads && (kRows * kGroups) % 32 == 0, "one item a thread; a warp's items in one map");
  const int item = tid, map = item / (kRows * kGroups), group = item % kGroups;
  const int row = PM ? map * kRows + item / kGroups % kRows : item / kGroups % kRows;  // in its map's tile
  const int tile = PM ? 0 : map;
  float q[16];
  float largest = 0.f;
  if (item < kItems) {
    const float* scale = args.p.k_scale + (V1 ? 2 * g + map : g) * D + group * 16;
    const char* q_tile = sQ + tile * q_tile_bytes;  // as loaded: swizzled, in T
    const T* lo = reinterpret_cast<const T*>(q_tile + swizzled_chunk<kChunks>(row, 2 * group) * 16);
    const T* hi = reinterpret_cast<const T*>(q_tile + swizzled_chunk<kChunks>(row, 2 * group + 1) * 16);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      q[j] = to_float(lo[j]) * (scale[j] / kv_code_unit(KV));
      q[8 + j] = to_float(hi[j]) * (scale[8 + j] / kv_code_unit(KV));
      largest = fmaxf(largest, fmaxf(fabsf(q[j]), fabsf(q[8 + j])));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
  if ((tid & 31) == 0) reduce[tid >> 5] = largest;
  __syncthreads();
  float alpha[2] = {1.f, 1.f};
  constexpr int kWarpsPerFoldMap = kRows * kGroups / 32;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    float most = 0.f;
    for (int w = 0; w < kWarpsPerFoldMap; ++w) most = fmaxf(most, reduce[m * kWarpsPerFoldMap + w]);
    if constexpr (S8) {
      alpha[m] = most > 0.f && most <= FLT_MAX ? most / 127.f : 1.f;
    } else {
      int exponent = 0;  // most / kFoldedQueryMax = f * 2^exponent, f in [0.5, 1) (0 for an all-zero Q)
      if (most > 0.f && most <= FLT_MAX) frexpf(most / kFoldedQueryMax, &exponent);
      alpha[m] = ldexpf(1.f, exponent);  // a power of two: exact to undo
    }
  }
  // (selects, not alpha[map]: a runtime index would put the pair in local memory)
  const float mine = map == 0 ? alpha[0] : alpha[1];
  if (S8 && item < kItems) {  // one 16-byte chunk of codes an item
    const float inv = 1.f / mine;
    uint32_t* chunk = reinterpret_cast<uint32_t*>(sQ + tile * q_tile_bytes + tile_chunk_offset<D, PAD>(row, group));
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c)
        word |= uint32_t(uint8_t(int8_t(max(-127, min(127, __float2int_rn(q[4 * w + c] * inv)))))) << (8 * c);
      chunk[w] = word;
    }
  } else if (item < kItems) {  // (every thread has read its Q: the barrier above)
    char* lo = sQ + tile * q_tile_bytes + tile_chunk_offset<D * 2, PAD>(row, 2 * group);
    char* hi = sQ + tile * q_tile_bytes + tile_chunk_offset<D * 2, PAD>(row, 2 * group + 1);
#pragma unroll
    for (int j = 0; j < 16; j += 2) {  // position j (pairs j, j+1) takes channel 4t + 2*(j >= 8) (and the next)
      const int t = (j & 7) >> 1, c = 4 * t + 2 * (j >> 3);
      const uint32_t pair = pack2(q[c] / mine, q[c + 1] / mine, __half());
      *reinterpret_cast<uint32_t*>(j < 8 ? lo + 2 * j : hi + 2 * (j - 8)) = pair;
    }
  }
  __syncthreads();  // the tiles are rewritten, and `reduce` may be used again
  return make_float2(alpha[0], alpha[1]);
}

// S += Q K^T on an 8-bit cache for the 16 rows of the fp16 Q tile and a warp's 16 keys (from k0) of
// each of N key-code tiles: s[2n], s[2n + 1] are tile n's two n-tiles of 8 keys. Key codes are read
// as b16 pairs: register i of lane (gq, tq) holds channels 4tq..4tq+3 of key gq of its 8 x
// 16-channel matrix (keys k0.. or k0+8.., channels of k-step 2ks or 2ks+1); Q's channels were
// reordered to match (fold_key_scales_into_query). Each Q fragment serves all N tiles.
template <int KV, int D, int Q_PAD, int K_PAD, int N>
__device__ __forceinline__ void qk_on_codes(float (&s)[2 * N][4], const char* q_tile, const char* const (&k_tiles)[N],
                                            int k0, int lane) {
  const int mi = lane >> 3;
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    const int key_chunk = tile_chunk_offset<D, K_PAD>(k0 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1));
    uint32_t bf[N][4];
#pragma unroll
    for (int n = 0; n < N; ++n) ldmatrix_x4(bf[n], k_tiles[n] + key_chunk);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t a[4];
      const int q_row = (lane & 7) + ((lane >> 3) & 1) * 8;
      ldmatrix_x4(a, q_tile + tile_chunk_offset<D * 2, Q_PAD>(q_row, (2 * ks + half) * 2 + (lane >> 4)));
#pragma unroll
      for (int n = 0; n < N; ++n) {
        mma_16816(s[2 * n], a, code_pair<KV, 0, 1>(bf[n][half]), code_pair<KV, 2, 3>(bf[n][half]), __half());
        mma_16816(s[2 * n + 1], a, code_pair<KV, 0, 1>(bf[n][2 + half]), code_pair<KV, 2, 3>(bf[n][2 + half]), __half());
      }
    }
  }
}

// S += Q K^T on an int8 cache with int8 Q codes (DIFFX_DECODE_KV_S8_QK): s8 mma m16n8k32 on the key
// codes as they were loaded. Per 32-channel k-step one ldmatrix x4 of each key tile gives a lane
// channels 4tq..4tq+3 and 16+4tq.. of keys gq and 8+gq (the s8 B fragments of both n-tiles), one of
// Q its A fragment; s[2n], s[2n + 1]: tile n's two n-tiles of 8 keys, set to the int32 sums in float.
template <int D, int Q_PAD, int K_PAD, int N>
__device__ __forceinline__ void qk_on_int8_codes(float (&s)[2 * N][4], const char* q_tile,
                                                 const char* const (&k_tiles)[N], int k0, int lane) {
  const int mi = lane >> 3;
  int sums[2 * N][4] = {};
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, q_tile + tile_chunk_offset<D, Q_PAD>((lane & 7) + ((lane >> 3) & 1) * 8, ks * 2 + (lane >> 4)));
    const int key_chunk = tile_chunk_offset<D, K_PAD>(k0 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1));
#pragma unroll
    for (int n = 0; n < N; ++n) {
      uint32_t bf[4];
      ldmatrix_x4(bf, k_tiles[n] + key_chunk);
      mma_16832_s8(sums[2 * n], a, bf[0], bf[1]);
      mma_16832_s8(sums[2 * n + 1], a, bf[2], bf[3]);
    }
  }
#pragma unroll
  for (int i = 0; i < 2 * N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[i][e] = __int2float_rn(sums[i][e]);
}

// PM: both maps in one row tile (DIFFX_DECODE_KV_PACK_MAPS; two tiles a step, at most 8 group rows).
template <typename T, int D, int DV, bool INT8, int STAGES, int KV = 0, int KT = 1, bool PM = false>
__global__ void __launch_bounds__(kThreads, D == 64 ? DIFFX_DECODE_D64_MIN_BLOCKS : 1)
    diff_attention_decode_kernel(const KernelArgs args) {
  using Cfg = DecodeTileConfig<T, D, DV, INT8, STAGES, KV, KT>;
  using Fwd = typename Cfg::Fwd;
  static_assert(!PM || (KV != 0 && KT * kBlockN == 2 * kWarpsPerMap * 16), "packed maps: 16 keys a warp, two tiles a step");
  // A warp's 16 x 16 score tile of each of the step's tiles it reads (packed maps: one), n-tiles of 8 keys.
  constexpr int kSTiles = PM ? 2 : 2 * KT;
  constexpr int kOTiles = DV / 8;   // n-tiles of the 16 x DV output accumulator of a warp
  // Int8 codes read with their bias (kv_codes.cuh): one more n-tile, P against ones, whose every
  // column is the sum of P as the mmas saw it (fp16), rescaled with O by the online softmax.
  constexpr int kBiasTiles = KV == kKvInt8 && DIFFX_DECODE_KV_BIAS ? 1 : 0;
  constexpr bool kOneBarrier = DIFFX_DECODE_BARRIERS_A_STEP == 1 && STAGES >= 3;
  constexpr bool kOverlap = DIFFX_DECODE_KV_OVERLAP && KV != 0 && kOneBarrier;
  // The warps that read a row copy it (DIFFX_DECODE_KV_WARP_COPIES): packed maps' warps their own
  // rows, else the two warps of a quarter half of theirs each.
  constexpr bool kWarpCopies = DIFFX_DECODE_KV_WARP_COPIES && PM && kOneBarrier;
  constexpr bool kPairCopies = DIFFX_DECODE_KV_WARP_COPIES && !PM && KV != 0 && kOneBarrier;
  constexpr bool kS8 = DIFFX_DECODE_KV_S8_QK && KV == kKvInt8;  // s8 Q.K^T on the key codes
  DIFFX_DYNAMIC_SHARED(smem);
  DIFFX_SHARED_ARRAY(float, reduce, 2 * kWarpsPerMap);
  // The last key each tile row sees under the causal mask, read in the masked block: in shared
  // memory, since the D = 64 kernels (two CTAs an SM, 128 registers) have no register to hold it.
  DIFFX_SHARED_ARRAY(int, row_last_key, kDecodeRows);

  launch_dependent_grids();  // the merge kernel (DIFFX_DECODE_PDL) waits for this whole grid anyway
  const DiffxAttentionParams& p = args.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // 0: map 1, 1: map 2 (warp-uniform). Packed maps: every warp has both (rows 0-7, 8-15), and this
  // names the step's tile whose keys it takes; the CTA's halves still write one map's part each.
  const int map = warp / kWarpsPerMap;
  // This warp's 16 keys of each tile (packed maps: of tile `map`). Pair copies: map 2's warps rotated
  // by one, so that the warps of a sub-partition (w and w + 4) are of different pairs.
  const int quarter = kPairCopies && map == 1 ? (warp + 1) % kWarpsPerMap : warp % kWarpsPerMap;
  const int gq = lane >> 2, tq = lane & 3;    // mma fragment coordinates (row group, column pair)
  const int heads = args.plan.heads_per_cta, h0 = blockIdx.x * heads, b = blockIdx.y, split = blockIdx.z;
  const int g = h0 / (p.num_heads / p.num_kv_heads);
  const int rows = heads * p.q_len;  // tile row r: head h0 + r / q_len, query token r % q_len

  char* sQ = smem;                                    // [2][16][D] T
  char* sQ8 = sQ + 2 * Cfg::kQTileBytes;              // [2][16][D] int8 (INT8 only)
  char* sKV = sQ8 + 2 * Cfg::kQ8TileBytes;  // STAGES x ([kKeyTiles][KT][64][D] T or int8, then [KT][64][DV] T or codes)
  auto sK = [&](int stage) { return sKV + stage * Cfg::kStageBytes; };
  auto sV = [&](int stage) { return sKV + stage * Cfg::kStageBytes + Fwd::kKeyTiles * Cfg::kKTileBytes; };
  // [STAGES][KT][64] int64: the key-mask flags of each stage's keys (DIFFX_DECODE_STAGED_FLAGS)
  auto sFlags = [&](int stage) { return reinterpret_cast<int64_t*>(sKV + STAGES * Cfg::kStageBytes + stage * Cfg::kFlagBytes); };
  constexpr bool kStagedFlags = DIFFX_DECODE_STAGED_FLAGS;

  const int n_total = (p.kv_len + kBlockN - 1) / kBlockN;
  const int nb_begin = split * args.plan.tiles_per_split;
  const int nb_end = min(n_total, nb_begin + args.plan.tiles_per_split);
  // Keys this split reads end here: a step of KT tiles past it (the plan gives an 8-bit cache whole
  // steps a split, so only at the cache's end) is zero-filled and masked.
  const int key_end = min(p.kv_len, nb_end * kBlockN);
  const int64_t* mask_row = p.key_mask ? p.key_mask + b * p.mask_batch_stride : nullptr;
  // Under a causal mask the last query token sees every key, so no tile of the split is skipped.

  const T* q_batch = static_cast<const T*>(p.query) + b * p.q_batch_stride;
  auto query_row = [&](int r, int m) {  // group row r's query of map m
    return reinterpret_cast<const char*>(q_batch + int64_t(r % p.q_len) * p.q_row_stride + (2 * (h0 + r / p.q_len) + m) * D);
  };
  if constexpr (PM) {  // map m's row r at row 8m + r of the first tile
    load_query_rows<D * sizeof(T)>(sQ, tid, [&](int row) { return row % 8 < rows; },
                                   [&](int row) { return query_row(row % 8, row / 8); });
  } else {
    for (int m = 0; m < 2; ++m)
      load_query_rows<D * sizeof(T)>(sQ + m * Cfg::kQTileBytes, tid, [&](int row) { return row < rows; },
                                     [&](int row) { return query_row(row, m); });
  }
  auto load_k = [&](int nb, int stage) { load_key_tiles<T, D, DV, INT8>(sK(stage), args, b, g, nb, tid); };
  auto load_v = [&](int nb, int stage) { load_value_tile<T, DV>(sV(stage), args, b, g, nb, tid); };
  // An 8-bit cache: the copies of key tile(s) (key heads 2g and 2g+1 for V1, else g) and value tile,
  // whole tiles by the CTA's threads, or by this warp's lanes its 16 rows of them (kWarpCopies) or
  // the half of its quarter's 16 rows that its map names (kPairCopies: rows k0 + 8 map ...).
  constexpr int kCopyThreads = kWarpCopies || kPairCopies ? 32 : kThreads;
  constexpr int kCopyRows = kWarpCopies ? 16 : kPairCopies ? 8 : kBlockN;
  const int copy_tid = kWarpCopies || kPairCopies ? lane : tid;
  const int copy_row = kWarpCopies ? quarter * 16 : kPairCopies ? quarter * 16 + 8 * map : 0;
  const CodeTileCopies<D, Cfg::kKRowPad, Fwd::kKeyTiles, Cfg::kKTileBytes, kCopyThreads, kCopyRows> k_copies(
      static_cast<const char*>(p.key) + b * p.k_batch_stride + (Fwd::kKeyTiles == 2 ? 2 * g : g) * D, p.k_row_stride,
      copy_tid, copy_row);
  const CodeTileCopies<DV, Cfg::kVRowPad, 1, 0, kCopyThreads, kCopyRows> v_copies(
      static_cast<const char*>(p.value) + b * p.v_batch_stride + g * DV, p.v_row_stride, copy_tid, copy_row);
  // A key-masked call's flags of the step's keys from tile nb into `stage`, copied with the keys by the
  // threads that copy them: copy_tid of the kCopyRows rows from copy_row of each of the step's tiles
  // (a warp's own, `map`, with kWarpCopies); a key past key_end gets 0 (absent), as its rows get zeros.
  auto load_flags = [&](int nb, int stage) {
    if constexpr (kStagedFlags) {
      constexpr int kTiles = kWarpCopies ? 1 : KT;
      const int first = kWarpCopies ? map : 0;
      const int i = copy_tid;
      if (mask_row && i < kTiles * kCopyRows) {
        const int slot = (first + i / kCopyRows) * kBlockN + copy_row + i % kCopyRows;
        const int key = nb * kBlockN + slot;
        cp_async_8(sFlags(stage) + slot, mask_row + (key < key_end ? key : 0), key < key_end);
      }
    }
  };
  static_assert(decltype(k_copies)::kTileBytes == Cfg::kKCodeTileBytes &&
                    decltype(v_copies)::kTileBytes == Cfg::kVCodeTileBytes,
                "the copies' tiles are the config's");
  // An 8-bit cache's copies of a step's KT tiles from tile nb into `stage`: the key tile(s), the
  // value tile or both (the overlapped loop takes them a step apart).
  auto load_codes = [&](int nb, int stage, bool keys, bool values) {
    if (keys) load_flags(nb, stage);
    // The CTA's copies take the step's KT tiles; a warp's own (kWarpCopies) its one tile, `map`.
    constexpr int kTiles = kWarpCopies ? 1 : KT;
    const int first = kWarpCopies ? map : 0;
    // One test a step: a step whose every row holds a key takes the copies alone.
    if (key_end - (nb + first) * kBlockN >= kTiles * kBlockN) {
      char* k_tiles[kTiles];
      char* v_tiles[kTiles];
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        k_tiles[t] = sK(stage) + (first + t) * Cfg::kKCodeTileBytes;
        v_tiles[t] = sV(stage) + (first + t) * Cfg::kVCodeTileBytes;
      }
      if (keys) k_copies.template issue_full_step<kTiles>(k_tiles, nb + first);
      if (values) v_copies.template issue_full_step<kTiles>(v_tiles, nb + first);
    } else {
#pragma unroll
      for (int t = first; t < first + kTiles; ++t) {
        const int rows = key_end - (nb + t) * kBlockN;
        if (keys) {
#pragma unroll
          for (int m = 0; m < Fwd::kKeyTiles; ++m)
            k_copies.issue(sK(stage) + m * Cfg::kKTileBytes + t * Cfg::kKCodeTileBytes, nb + t, m, rows);
        }
        if (values) v_copies.issue(sV(stage) + t * Cfg::kVCodeTileBytes, nb + t, 0, rows);
      }
    }
  };
  auto load_kv = [&](int nb, int stage) {  // the KT tiles from tile nb
    if constexpr (KV) {
      load_codes(nb, stage, true, true);
    } else {
      load_k(nb, stage);
      load_flags(nb, stage);
      load_v(nb, stage);
    }
  };

  if constexpr (kOverlap) {
    // The key ring leads the value ring by a step (step i's keys and step i - 1's values are read
    // together): group 0 holds Q, K(0), V(0) and K(1); group m then V(m) and K(m + 1). Stage s holds
    // the keys and the values of the steps i with i % STAGES == s, as in the loop below.
    load_codes(nb_begin, 0, true, true);
    if (nb_begin + KT < nb_end) load_codes(nb_begin + KT, 1, true, false);
    cp_async_commit();
#pragma unroll
    for (int i = 1; i + 1 < STAGES; ++i) {
      if (nb_begin + i * KT < nb_end) load_codes(nb_begin + i * KT, i, false, true);
      if (nb_begin + (i + 1) * KT < nb_end) load_codes(nb_begin + (i + 1) * KT, i + 1, true, false);
      cp_async_commit();
    }
  } else {
    // STAGES - 1 tiles in flight ahead of the one computed (one group each, empty past the split's end).
    load_kv(nb_begin, 0);
    cp_async_commit();
#pragma unroll
    for (int i = 1; i + 1 < STAGES; ++i) {
      if (nb_begin + i * KT < nb_end) load_kv(nb_begin + i * KT, i);
      cp_async_commit();
    }
  }

  float qk_alpha = 1.f;     // an 8-bit cache: logits = alpha * (folded Q, fp16 or int8 codes) . codes
  float map2_to_map1 = 1.f;  // packed maps: map 2's alpha over map 1's (fp16 Q: a power of two), onto its rows' S
  if constexpr (KV != 0) {  // Q lands with the first tile (before the accumulators are live: fewer registers)
    cp_async_wait_group<STAGES - 2>();
    __syncthreads();
    const float2 alpha =
        fold_key_scales_into_query<T, D, Fwd::kV1, KV, Cfg::kQRowPad, PM, kS8>(sQ, Cfg::kQTileBytes, args, g, reduce,
                                                                               tid);
    qk_alpha = PM || map == 0 ? alpha.x : alpha.y;
    map2_to_map1 = alpha.y / alpha.x;
  }
  float q_scale = 1.f;
  if constexpr (INT8) {
    cp_async_wait_all();
    __syncthreads();
    q_scale = quantise_q_tile<T, D, kDecodeRows>(sQ + map * Cfg::kQTileBytes, sQ8 + map * Cfg::kQ8TileBytes,
                                                 args.qmax, reduce, tid, map);
  }
  // In this CTA the logits are kept as S' = S / qk_alpha (an 8-bit cache's folded Q, else alpha 1):
  // the exponent's scale takes alpha instead, and the parts written for the merge are in raw logit units.
  const float scale_log2 = args.scale * kLog2e * qk_alpha;
  const int key_head = Fwd::kV1 ? 2 * g + map : g;
  // Key-masked steps tested as bits, and a step whose keys are all present and not cut by the causal
  // diagonal skipping the masked block (mask_step): the flags staged in shared memory with the keys
  // (DIFFX_DECODE_STAGED_FLAGS), or loaded in the step: at head dim 128 before its Q.K^T, at head
  // dim 64 after it (two CTAs an SM at 128 registers: every form that held the flags across Q.K^T
  // spilled 4-32 bytes in one of the builds, sm_86/89, packed maps, warp copies, overlap).
  constexpr bool kFlagsBeforeQK = D != 64 && !kStagedFlags;
  // Tile row r is query token r % q_len (packed maps: of r % 8), which sees keys up to kv_len -
  // q_len + that. (Rows >= `rows`, of each half with packed maps, are padding: computed, never written.)
  if (tid < kDecodeRows) row_last_key[tid] = (PM ? tid % 8 : tid) % p.q_len + p.kv_len - p.q_len;
  __syncthreads();

  float acc_o[kOTiles + kBiasTiles][4];
#pragma unroll
  for (int i = 0; i < kOTiles + kBiasTiles; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const int k0 = quarter * 16;  // this warp's first key in each tile
  const int mi = lane >> 3;

  // S = Q K^T for the 16 query rows and this warp's 16 keys of each tile of the step from tile nb,
  // its keys at `stage` (s[2t], s[2t + 1]: tile t).
  auto qk_step = [&](int nb, int stage, float (&s)[kSTiles][4]) {
#pragma unroll
    for (int i = 0; i < kSTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    if constexpr (INT8) {
      constexpr int kChunks8 = D / 16;
      const char* q_tile = sQ8 + map * Cfg::kQ8TileBytes;
      const char* k_tile = sK(stage) + (Fwd::kV1 ? map : 0) * Fwd::kKTileBytes;
      int si[kSTiles][4];
#pragma unroll
      for (int i = 0; i < kSTiles; ++i) si[i][0] = si[i][1] = si[i][2] = si[i][3] = 0;
#pragma unroll
      for (int ks = 0; ks < D / 32; ++ks) {
        uint32_t a[4], bf[4];
        ldmatrix_x4(a, q_tile + swizzled_chunk<kChunks8>((lane & 7) + ((lane >> 3) & 1) * 8, ks * 2 + (lane >> 4)) * 16);
        ldmatrix_x4(bf, k_tile + swizzled_chunk<kChunks8>(k0 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)) * 16);
        mma_16832_s8(si[0], a, bf[0], bf[1]);
        mma_16832_s8(si[1], a, bf[2], bf[3]);
      }
      const float qk_scale = q_scale * args.k_scales[(int64_t(b) * args.key_maps + key_head) * args.n_kv_blocks + nb];
#pragma unroll
      for (int i = 0; i < kSTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = __int2float_rn(si[i][e]) * qk_scale;
    } else if constexpr (PM) {
      // Packed maps: this warp's 16 keys of tile `map` of the step, against K1 for rows 0-7 (map 1)
      // and K2 for rows 8-15 (V2: the one K for both). A lane's fragment holds row gq (elements 0,
      // 1) and row gq + 8 (2, 3): each mma keeps the half of its map, and map 2's logits move to
      // map 1's alpha (exact: a power of two), so that one exponent scale serves every row.
      constexpr int kMaps = Fwd::kV1 ? 2 : 1;
      const char* k_tiles[kMaps];
#pragma unroll
      for (int m = 0; m < kMaps; ++m) k_tiles[m] = sK(stage) + m * Cfg::kKTileBytes + map * Cfg::kKCodeTileBytes;
      float both[2 * kMaps][4];
      if constexpr (kS8) {
        qk_on_int8_codes<D, Cfg::kQRowPad, Cfg::kKRowPad, kMaps>(both, sQ, k_tiles, k0, lane);
      } else {
#pragma unroll
        for (int i = 0; i < 2 * kMaps; ++i) both[i][0] = both[i][1] = both[i][2] = both[i][3] = 0.f;
        qk_on_codes<KV, D, Cfg::kQRowPad, Cfg::kKRowPad, kMaps>(both, sQ, k_tiles, k0, lane);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        s[i][0] = both[i][0];
        s[i][1] = both[i][1];
        s[i][2] = both[2 * (kMaps - 1) + i][2] * map2_to_map1;
        s[i][3] = both[2 * (kMaps - 1) + i][3] * map2_to_map1;
      }
    } else if constexpr (KV != 0) {
      // This map's Q against its key tile of each of the step's KT tiles.
      const char* k_tile = sK(stage) + (Fwd::kV1 ? map : 0) * Cfg::kKTileBytes;
      const char* k_tiles[KT];
#pragma unroll
      for (int t = 0; t < KT; ++t) k_tiles[t] = k_tile + t * Cfg::kKCodeTileBytes;
      if constexpr (kS8) {
        qk_on_int8_codes<D, Cfg::kQRowPad, Cfg::kKRowPad, KT>(s, sQ + map * Cfg::kQTileBytes, k_tiles, k0, lane);
      } else {
        qk_on_codes<KV, D, Cfg::kQRowPad, Cfg::kKRowPad, KT>(s, sQ + map * Cfg::kQTileBytes, k_tiles, k0, lane);
      }
    } else {
      constexpr int kChunks = D / 8;
      const char* q_tile = sQ + map * Cfg::kQTileBytes;
      const char* k_tile = sK(stage) + (Fwd::kV1 ? map : 0) * Fwd::kKTileBytes;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4], bf[4];
        ldmatrix_x4(a, q_tile + swizzled_chunk<kChunks>((lane & 7) + ((lane >> 3) & 1) * 8, ks * 2 + (lane >> 4)) * 16);
        ldmatrix_x4(bf, k_tile + swizzled_chunk<kChunks>(k0 + (mi >> 1) * 8 + (lane & 7), ks * 2 + (mi & 1)) * 16);
        mma_16816(s[0], a, bf[0], bf[1], T());
        mma_16816(s[1], a, bf[2], bf[3], T());
      }
    }
  };

  // Keys past the split's end, after the bottom-right diagonal, padding (key_mask). A warp's keys of
  // a step: j = 0 .. kWarpKeys - 1, its 16 of each tile (packed maps: of tile `map`), their flags read
  // from the stage or loaded (key_flags; masked_scores below) and tested as bits (present_keys).
  constexpr int kWarpKeys = PM ? 16 : 16 * KT;
  auto key_of = [&](int nb, int j) { return nb * kBlockN + (PM ? map : j >> 4) * kBlockN + k0 + (j & 15); };
  auto step_flags = [&](int nb) {
    return key_flags<kWarpKeys>(mask_row, key_end, lane, [&](int j) { return key_of(nb, j); });
  };
  // ... or read from the stage's flags (a lane its key j's: 2 wavefronts a warp)
  auto staged_flags = [&](int stage) {
    KeyFlags<kWarpKeys> f;
    const int64_t* flags = sFlags(stage);
#pragma unroll
    for (int h = 0; h < KeyFlags<kWarpKeys>::kLoads; ++h) {
      const int j = 32 * h + lane;
      const int slot = (PM ? map : j >> 4) * kBlockN + k0 + (j & 15);
      f.flag[h] = kWarpKeys >= 32 || j < kWarpKeys ? flags[slot] : 0;
    }
    return f;
  };
  // The warp's keys of the step that row r of this lane's (gq + 8r) sees under the causal mask, as
  // bits: a prefix of each tile's 16.
  auto causal_bits = [&](int nb, int r) {
    using Bits = typename KeyFlags<kWarpKeys>::Bits;
    const int last = row_last_key[gq + 8 * r];
    Bits bits = 0;
#pragma unroll
    for (int t = 0; t < kWarpKeys / 16; ++t) {
      const int seen = min(max(last - key_of(nb, 16 * t) + 1, 0), 16);  // of the tile's 16 keys, a prefix
      bits |= Bits((1u << seen) - 1u) << (16 * t);
    }
    return bits;
  };
  auto mask_step = [&](int nb, int stage, float (&s)[kSTiles][4], const KeyFlags<kWarpKeys>& flags) {
    const int n_start = nb * kBlockN;
    const bool edge = n_start + KT * kBlockN > key_end;
    const bool diagonal = p.causal && n_start + KT * kBlockN - 1 > p.kv_len - p.q_len;
    // (staged: a null mask's keys past key_end from key_flags, which then loads nothing)
    const auto present = kStagedFlags ? (mask_row ? present_keys(staged_flags(stage))
                                                  : edge ? present_keys(step_flags(nb)) : KeyFlags<kWarpKeys>::kAll)
                                      : mask_row || edge ? present_keys(flags) : KeyFlags<kWarpKeys>::kAll;
    if (diagonal || present != KeyFlags<kWarpKeys>::kAll) {
      // bit c of row r's: this lane's key j = c + tq * 2 of the step is visible to it
      const auto row0 = (diagonal ? present & causal_bits(nb, 0) : present) >> (tq * 2);
      const auto row1 = (diagonal ? present & causal_bits(nb, 1) : present) >> (tq * 2);
#pragma unroll
      for (int i = 0; i < kSTiles; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = (PM ? 0 : (i >> 1) * 16) + (i & 1) * 8 + (e & 1);  // j less tq * 2
          if (!((((e >> 1) ? row1 : row0) >> c) & 1)) s[i][e] = -INFINITY;
        }
    }
  };

  // S of a step, masked; the flags read from the stage after its Q.K, or loaded in the step: before
  // its Q.K, whose mmas hide their latency (at head dim 64 after it: kFlagsBeforeQK).
  auto masked_scores = [&](int nb, int stage, float (&s)[kSTiles][4]) {
    KeyFlags<kWarpKeys> flags{};
    if constexpr (kFlagsBeforeQK) flags = step_flags(nb);
    qk_step(nb, stage, s);
    if constexpr (!kFlagsBeforeQK && !kStagedFlags) flags = step_flags(nb);
    mask_step(nb, stage, s, flags);
  };


  // P (the exponentials of S, this warp's partial softmax) as the A operand of P.V, one 16-key
  // k-step a tile; on an 8-bit cache in fp16 (values in [0, 1]).
  using PType = std::conditional_t<KV != 0, __half, T>;
  auto pack_p = [&](const float (&s)[kSTiles][4], uint32_t (&pa)[kSTiles / 2][4]) {
#pragma unroll
    for (int i = 0; i < kSTiles / 2; ++i) {
      pa[i][0] = pack2(s[2 * i][0], s[2 * i][1], PType());
      pa[i][1] = pack2(s[2 * i][2], s[2 * i][3], PType());
      pa[i][2] = pack2(s[2 * i + 1][0], s[2 * i + 1][1], PType());
      pa[i][3] = pack2(s[2 * i + 1][2], s[2 * i + 1][3], PType());
    }
  };

  // O += P V over this warp's 16 keys of each tile of the step whose values are at `stage`.
  auto pv_step = [&](int stage, const uint32_t (&pa)[kSTiles / 2][4]) {
#pragma unroll
    for (int i = 0; i < kSTiles / 2; ++i) {
      const uint32_t(&a)[4] = pa[i];
      if constexpr (KV != 0) {
        const int t = PM ? map : i;  // the step's tile of these keys
        // Value codes through ldmatrix .trans as b16 pairs: register i of lane (gq, tq) holds keys
        // 2tq and 2tq+1 (low, high half) of channels 2gq and 2gq+1 of its 8-key x 16-channel matrix.
        // Its even channels make one n-tile's B fragment, its odd ones another: accumulator tile i
        // holds channels 16(i/2) + 2n + (i&1) at column n (kv_output_channel).
        const int v_row = k0 + (mi & 1) * 8 + (lane & 7);
        const char* v_tile = sV(stage) + t * Cfg::kVCodeTileBytes;
        // (padded rows: the lane's address once, each gp's an immediate from it)
        const char* v_lane = v_tile + tile_chunk_offset<DV, Cfg::kVRowPad>(v_row, mi >> 1);
#pragma unroll
        for (int gp = 0; gp < DV / 32; ++gp) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, Cfg::kVRowPad ? v_lane + gp * 32
                                            : v_tile + tile_chunk_offset<DV, 0>(v_row, gp * 2 + (mi >> 1)));
#pragma unroll
          for (int G = 0; G < 2; ++G) {
            mma_16816(acc_o[4 * gp + 2 * G], a, code_pair<KV, 0, 2>(r[2 * G]), code_pair<KV, 0, 2>(r[2 * G + 1]), __half());
            mma_16816(acc_o[4 * gp + 2 * G + 1], a, code_pair<KV, 1, 3>(r[2 * G]), code_pair<KV, 1, 3>(r[2 * G + 1]), __half());
          }
        }
        if constexpr (kBiasTiles) mma_16816(acc_o[kOTiles], a, 0x3c003c00u, 0x3c003c00u, __half());  // fp16 ones
      } else {
        constexpr int kVChunks = DV / 8;
#pragma unroll
        for (int np = 0; np < kOTiles / 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, sV(stage) + swizzled_chunk<kVChunks>(k0 + (mi & 1) * 8 + (lane & 7), np * 2 + (mi >> 1)) * 16);
          mma_16816(acc_o[2 * np], a, bf[0], bf[1], T());
          mma_16816(acc_o[2 * np + 1], a, bf[2], bf[3], T());
        }
      }
    }
  };

  // A step's meeting once its tiles have landed: the CTA's, or the warps that copy what they read:
  // this warp's lanes (kWarpCopies) or its quarter's pair of warps (kPairCopies: named barrier
  // 1 + quarter). "Every thread" and "every warp" below are then theirs.
  auto step_barrier = [quarter] {
    if constexpr (kWarpCopies) __syncwarp();
    else if constexpr (kPairCopies) named_barrier_sync<2 * 32>(1 + quarter);
    else __syncthreads();
  };

  if constexpr (kOverlap) {
    // FlashAttention-3's intra-warpgroup overlap on mma.sync: step i + 1's Q.K^T is issued before
    // step i's P.V, and its softmax runs beside that P.V, so that one step's exponentials and
    // reductions fill the gaps of the other's conversions and mmas (one block of code, which ptxas
    // interleaves). P of step i and S of step i + 1 are live at once. Stage s holds K(i + 1) and
    // V(i) of the step computed, so the refill after the barrier takes K(i + STAGES) into step i's
    // stage and V(i + STAGES - 1) into step i - 1's: every warp has read both (the last step's Q.K
    // and P.V), and STAGES - 1 steps stay in flight while a step is computed, as in the loop below.
    uint32_t pa[kSTiles / 2][4];
    if (nb_begin < nb_end) {  // step 0's softmax: its tiles landed before the fold above
      float s[kSTiles][4];
      masked_scores(nb_begin, 0, s);
      online_softmax_step(s, acc_o, row_max, row_sum, scale_log2);
      pack_p(s, pa);
    }
    int stage = 0;  // (nb - nb_begin) / KT % STAGES: step i's values, step i + 1's keys at the next
    for (int nb = nb_begin; nb < nb_end; nb += KT) {
      const int next_stage = stage == STAGES - 1 ? 0 : stage + 1;
      const int last_stage = stage == 0 ? STAGES - 1 : stage - 1;
      cp_async_wait_group<STAGES - 2>();  // K(i + 1) and V(i) landed; the steps after it stay in flight
      step_barrier();                      // ... for every thread, and every warp has left step i - 1
      if (nb + STAGES * KT < nb_end) load_codes(nb + STAGES * KT, stage, true, false);
      if (nb + (STAGES - 1) * KT < nb_end) load_codes(nb + (STAGES - 1) * KT, last_stage, false, true);
      cp_async_commit();
      if (nb + KT < nb_end) {
        float s[kSTiles][4];
        masked_scores(nb + KT, next_stage, s);
        pv_step(stage, pa);
        online_softmax_step(s, acc_o, row_max, row_sum, scale_log2);  // (O's rescale after its P.V)
        pack_p(s, pa);
      } else {
        pv_step(stage, pa);
      }
      stage = next_stage;
    }
  } else {
    int stage = STAGES - 1;  // (nb - nb_begin) % STAGES, stepped: no division a tile
    for (int nb = nb_begin; nb < nb_end; nb += KT) {
      const int ahead_stage = stage;  // the stage read in the previous step
      stage = stage == STAGES - 1 ? 0 : stage + 1;
      const int ahead = nb + (STAGES - 1) * KT;  // the step STAGES - 1 ahead: to the stage read in the previous one
      if constexpr (STAGES >= 2 && !kOneBarrier) {
        if (ahead < nb_end) load_kv(ahead, ahead_stage);  // that step ended with a barrier
        cp_async_commit();
        cp_async_wait_group<STAGES - 1>();  // K(nb) and V(nb) landed; the tiles after it stay in flight
      } else if constexpr (kOneBarrier) {
        cp_async_wait_group<STAGES - 2>();  // K(nb) and V(nb) landed; the tiles after it stay in flight
      } else {
        cp_async_wait_all();                // K(nb) and V(nb) landed
      }
      step_barrier();                       // ... for every thread (kOneBarrier: and every warp has left the last step)
      if constexpr (kOneBarrier) {
        if (ahead < nb_end) load_kv(ahead, ahead_stage);
        cp_async_commit();
      }

      float s[kSTiles][4];
      masked_scores(nb, stage, s);

      if (STAGES == 1) {
        __syncthreads();  // every warp has read K(nb): the next K tile may land while P.V runs
        if (nb + 1 < nb_end) {
          load_k(nb + 1, 0);
          load_flags(nb + 1, 0);  // (read in masked_scores, before the barrier above)
          cp_async_commit();
        }
      }

      online_softmax_step(s, acc_o, row_max, row_sum, scale_log2);  // this warp's partial state
      uint32_t pa[kSTiles / 2][4];
      pack_p(s, pa);
      pv_step(stage, pa);

      if constexpr (!kOneBarrier) __syncthreads();  // every warp has read this stage's K and V
      if (STAGES == 1 && nb + 1 < nb_end) {
        load_v(nb + 1, 0);
        cp_async_commit();
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();  // every K/V stage is read: their space becomes the merge buffer
  if constexpr (kBiasTiles) {  // O = P.(code + bias) - bias * sum(P), in fp32
#pragma unroll
    for (int i = 0; i < kOTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[i][e] = fmaf(-kInt8CodeBias, acc_o[kOTiles][e], acc_o[i][e]);
  }

  // The warps of each map (packed maps: all 8, each holding both) merged into one state: each
  // warp's (max, sum) of its rows, the map's max M per row, then each warp's P.V sums rescaled to M
  // and added into the buffer in warp order (a barrier between warps: the same sum on every run).
  constexpr int kStride = kMergeStride<DV, KV != 0>;
  static_assert(kStride % 32 == (KV != 0 ? 16 : 8), "a warp's rows 8 (float2) or 16 (float4) banks apart: no conflicts");
  float* merged = reinterpret_cast<float*>(sKV);  // [2 maps][16 rows][kStride] floats
  float* warp_ml = merged + 2 * kDecodeRows * kStride;  // [8 warps][16 tile rows][max, sum]
  static_assert(kMergeBufferBytes<DV, KV != 0> <= STAGES * Cfg::kStageBytes, "the merge buffer reuses the K/V stages");
  constexpr int kStateWarps = PM ? 2 * kWarpsPerMap : kWarpsPerMap;  // warps holding a map's rows
  // Row `row` of map m: the max over its warps' maxima and the sum of their sums at that max
  // (0 with max -inf when no key of the split is visible to the row).
  auto map_state = [&](int m, int row) {
    const float* ml = warp_ml + ((PM ? 0 : m * kWarpsPerMap) * kDecodeRows + (PM ? 8 * m + row : row)) * 2;
    float mx = -INFINITY, l = 0.f;
#pragma unroll
    for (int q = 0; q < kStateWarps; ++q) mx = fmaxf(mx, ml[q * kDecodeRows * 2]);
#pragma unroll
    for (int q = 0; q < kStateWarps; ++q) {
      const float m_q = ml[q * kDecodeRows * 2];
      if (m_q != -INFINITY) l = fmaf(ml[q * kDecodeRows * 2 + 1], fast_exp2((m_q - mx) * scale_log2), l);
    }
    return make_float2(mx, l);
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tq == 0) {  // (in quarter order within a map: pair copies rotate map 2's warps)
      float* ml = warp_ml + ((kPairCopies ? map * kWarpsPerMap + quarter : warp) * kDecodeRows + gq + r * 8) * 2;
      ml[0] = row_max[r];
      ml[1] = l;
    }
  }
  __syncthreads();
  // This lane's rows r = 0, 1 (tile rows gq, gq + 8) as (map, row of the map).
  auto row_map = [&](int r) { return PM ? r : map; };
  auto row_of_map = [&](int r) { return PM ? gq : gq + r * 8; };
  float w[2];  // this warp's rescale to the map's max
#pragma unroll
  for (int r = 0; r < 2; ++r)
    w[r] = row_max[r] == -INFINITY ? 0.f
                                   : fast_exp2((row_max[r] - map_state(row_map(r), row_of_map(r)).x) * scale_log2);
#pragma unroll 1
  for (int q = 0; q < kStateWarps; ++q) {
    if ((PM ? warp : quarter) == q) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float* row = merged + (row_map(r) * kDecodeRows + row_of_map(r)) * kStride;
#pragma unroll
        for (int i = 0; i < kOTiles; ++i) {
          if constexpr (KV != 0) {
            // Tile i's column 2tq + e is channel 16(i/2) + 4tq + 2e + (i&1): tiles i and i + 1 (i even)
            // give this lane channels 16(i/2) + 4tq ... + 3, one float4. (Until 2026-11-29 one float
            // each: 4x the instructions, each a 4-way bank conflict at a stride of DV + 8.)
            if (i & 1) continue;
            float4* out = reinterpret_cast<float4*>(row + 16 * (i >> 1) + 4 * tq);
            const float4 mine = make_float4(acc_o[i][2 * r] * w[r], acc_o[i + 1][2 * r] * w[r],
                                            acc_o[i][2 * r + 1] * w[r], acc_o[i + 1][2 * r + 1] * w[r]);
            if (q > 0) {  // (a store in each branch: no register copies of `mine`, which the loop keeps)
              const float4 before = *out;
              *out = make_float4(mine.x + before.x, mine.y + before.y, mine.z + before.z, mine.w + before.w);
            } else {
              *out = mine;
            }
          } else {
            float2 sum = make_float2(acc_o[i][2 * r] * w[r], acc_o[i][2 * r + 1] * w[r]);
            if (q > 0) {
              const float2 before = *reinterpret_cast<const float2*>(row + tq * 2 + i * 8);
              sum.x += before.x;
              sum.y += before.y;
            }
            *reinterpret_cast<float2*>(row + tq * 2 + i * 8) = sum;
          }
        }
      }
    }
    __syncthreads();
  }

  // The map's part for this split, unnormalised (valid query rows only): its 128 threads copy the
  // buffer's rows out as float4s; the map's first 16 threads write each row's max and sum.
  const int part = split;
  const int map_tid = tid % (kWarpsPerMap * 32);
  if (map_tid < rows) {
    const int64_t state = part_index(args, b, h0 + map_tid / p.q_len, map, part) + map_tid % p.q_len;
    float2 ml = map_state(map, map_tid);
    // Raw logit units (-inf stays -inf). qk_alpha, a power of two, comes back exactly out of the
    // exponent's scale: one register fewer through the loop (the V1 d = 64 int8 kernel's 128).
    ml.x *= scale_log2 / (args.scale * kLog2e);
    *reinterpret_cast<float2*>(args.part_ml + state * 2) = ml;
  }
  constexpr int kQuads = DV / 4;
  for (int i = map_tid; i < rows * kQuads; i += kWarpsPerMap * 32) {
    const int row = i / kQuads, c = 4 * (i % kQuads);
    const int64_t state = part_index(args, b, h0 + row / p.q_len, map, part) + row % p.q_len;
    *reinterpret_cast<float4*>(args.part_o + state * DV + c) =
        *reinterpret_cast<const float4*>(merged + (map * kDecodeRows + row) * kStride + c);
  }
}

// The sum (kMax false) or the max (kMax true) over the CTA's threads of each of two values, in
// every thread. scratch: 2 floats per warp.
template <int kWarps, bool kMax>
__device__ __forceinline__ void block_all_reduce2(float (&v)[2], float* scratch, int tid) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], off);
      v[i] = kMax ? fmaxf(v[i], other) : v[i] + other;
    }
  if ((tid & 31) == 0) {
    scratch[2 * (tid >> 5)] = v[0];
    scratch[2 * (tid >> 5) + 1] = v[1];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    v[i] = scratch[i];
    for (int w = 1; w < kWarps; ++w) v[i] = kMax ? fmaxf(v[i], scratch[2 * w + i]) : v[i] + scratch[2 * w + i];
  }
  __syncthreads();  // the scratch may be written again
}

// Threads of a merge CTA: 256 (a multiple of every DV / 4). Only the emulator's sanitizer builds
// lower it (tests/test_kernel_sanitized.py: 64, one to four groups), as they lower the split target.
#ifndef DIFFX_MERGE_THREADS
#define DIFFX_MERGE_THREADS 256
#endif
constexpr int kMergeThreads = DIFFX_MERGE_THREADS;
// The merge kernel's dynamic shared memory: each group's sums of both maps, kGroups * 2 * DV
// floats, which is 8 floats a thread whatever DV (dynamic, so that static shared memory stays
// within kStaticSmemBudget like every kernel's).
constexpr int kMergeSmemBytes = kMergeThreads * 8 * int(sizeof(float));

// Kernel 2, one CTA of kMergeThreads per (diff-head, batch element, query token): grid x = diff-head,
// y = batch, z = query token. The parts (one per split) are merged side by side, not one after
// another (a serial loop waits on one L2 round trip per part): the CTA's threads first stride
// over the parts for each map's max and softmax denominator, then groups of DV/4 threads (4
// output channels each) sum a share of the parts each, and the groups' sums meet in shared memory.
template <typename T, int DV>
__global__ void __launch_bounds__(kMergeThreads) diff_attention_decode_merge_kernel(const KernelArgs args) {
  constexpr int kQuads = DV / 4;                   // threads of a group: 4 output channels each
  constexpr int kGroups = kMergeThreads / kQuads;  // groups, each summing every kGroups-th part
  constexpr int kWarps = kMergeThreads / 32;
  static_assert(kMergeThreads % kQuads == 0 && kGroups >= 1, "whole groups of DV/4 threads");
  static_assert(kGroups * 2 * DV * int(sizeof(float)) == kMergeSmemBytes, "the groups' sums fill the dynamic shared memory");
  DIFFX_SHARED_ARRAY(float, reduce, 2 * kWarps);
  DIFFX_DYNAMIC_SHARED(smem);
  float* group_sums = reinterpret_cast<float*>(smem);  // [group][map][channel]
  const DiffxAttentionParams& p = args.p;
  const int h = blockIdx.x, b = blockIdx.y, qi = blockIdx.z, tid = threadIdx.x;
  const int parts = args.decode_parts;
  const float scale_log2 = args.scale * kLog2e;
  int64_t first[2];  // part k of map m: state first[m] + k * q_len
  for (int map = 0; map < 2; ++map) first[map] = part_index(args, b, h, map, 0) + qi;
  wait_for_prior_grids();  // the split kernel's parts, when launched early (DIFFX_DECODE_PDL)

  // Each map's max over its parts, then its softmax denominator (the parts' sums at that max).
  float mx[2] = {-INFINITY, -INFINITY};
  for (int k = tid; k < parts; k += kMergeThreads)
    for (int map = 0; map < 2; ++map) mx[map] = fmaxf(mx[map], args.part_ml[(first[map] + int64_t(k) * p.q_len) * 2]);
  block_all_reduce2<kWarps, true>(mx, reduce, tid);
  float l[2] = {0.f, 0.f};
  for (int k = tid; k < parts; k += kMergeThreads)
    for (int map = 0; map < 2; ++map) {
      const int64_t row = first[map] + int64_t(k) * p.q_len;
      const float m_k = args.part_ml[row * 2];
      if (m_k != -INFINITY) l[map] = fmaf(args.part_ml[row * 2 + 1], fast_exp2((m_k - mx[map]) * scale_log2), l[map]);
    }
  block_all_reduce2<kWarps, false>(l, reduce, tid);  // 0 when no key of any part is visible to this row

  // This group's share of each map's weighted sum of the parts' outputs.
  const int group = tid / kQuads, c = 4 * (tid % kQuads);
  for (int map = 0; map < 2; ++map) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int k = group; k < parts; k += kGroups) {
      const int64_t row = first[map] + int64_t(k) * p.q_len;
      const float m_k = args.part_ml[row * 2];
      if (m_k == -INFINITY) continue;  // this part saw no key (its sums are 0)
      const float w = fast_exp2((m_k - mx[map]) * scale_log2);
      const float4 part = *reinterpret_cast<const float4*>(args.part_o + row * DV + c);
      acc.x = fmaf(part.x, w, acc.x);
      acc.y = fmaf(part.y, w, acc.y);
      acc.z = fmaf(part.z, w, acc.z);
      acc.w = fmaf(part.w, w, acc.w);
    }
    *reinterpret_cast<float4*>(group_sums + (group * 2 + map) * DV + c) = acc;
  }
  __syncthreads();

  // Every group finishes its 4 channels (the same values in each group); group 0 writes them.
  float y[4];
  {
    float o[2][4] = {};
    for (int g = 0; g < kGroups; ++g)
      for (int map = 0; map < 2; ++map)
#pragma unroll
        for (int j = 0; j < 4; ++j) o[map][j] += group_sums[(g * 2 + map) * DV + c + j];
    const T* lambda = static_cast<const T*>(p.lambda_full);
    const float lam = p.variant == 1
                          ? to_float(lambda[0])
                          : to_float(lambda[b * p.lambda_batch_stride + int64_t(qi) * p.lambda_row_stride +
                                            h * p.lambda_head_stride]);
    const float inv_l0 = l[0] > 0.f ? 1.f / l[0] : 0.f, inv_l1 = l[1] > 0.f ? 1.f / l[1] : 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = o[0][j] * inv_l0 - lam * (o[1][j] * inv_l1);
    if (p.v_scale) {  // an 8-bit cache: V's channel scales (over kv_code_unit), folded out of the loop
      const float* v_scale = p.v_scale + (h / (p.num_heads / p.num_kv_heads)) * DV + c;
#pragma unroll
      for (int j = 0; j < 4; ++j) y[j] *= v_scale[j] / kv_code_unit(p.kv_format);
    }
  }
  float rms = 1.f;
  if (p.norm) {
    float sumsq[2] = {group == 0 ? y[0] * y[0] + y[1] * y[1] + y[2] * y[2] + y[3] * y[3] : 0.f, 0.f};
    block_all_reduce2<kWarps, false>(sumsq, reduce, tid);
    rms = rsqrtf(sumsq[0] / float(DV) + p.norm_eps);
  }
  if (group != 0) return;
  T* out = static_cast<T*>(p.output) + b * p.o_batch_stride + int64_t(qi) * p.o_row_stride + h * DV + c;
  const float gain = rms * p.output_scale;
  *reinterpret_cast<uint32_t*>(out) = pack2(y[0] * gain * p.norm_weight[c], y[1] * gain * p.norm_weight[c + 1], T());
  *reinterpret_cast<uint32_t*>(out + 2) = pack2(y[2] * gain * p.norm_weight[c + 2], y[3] * gain * p.norm_weight[c + 3], T());
}

// A decode kernel's K/V pipeline: its stages and the 64-key tiles it takes a step (and whether both
// maps share one row tile, DIFFX_DECODE_KV_PACK_MAPS).
template <int STAGES, int KT, bool PM = false>
struct DecodePipeline {
  static constexpr int kStages = STAGES, kKeyTiles = KT;
  static constexpr bool kPackedMaps = PM;
};

// run(DecodePipeline<...>{}) with the first pipeline of a decode instance that fits a GPU whose
// blocks may opt in to smem_optin() bytes (asked only when the first does not fit every GPU). An
// 8-bit cache: DIFFX_DECODE_KV_TILES tiles a step in DIFFX_DECODE_KV_STAGES stages ("wide"), else
// one tile a step in as many ("deep"), else one in two ("few"). A float cache: two stages of one
// tile, else one stage. Only the pipelines some GPU can take are instantiated. group_rows: the
// call's heads a CTA x query tokens (packed maps where they fit 8, with two tiles a step).
template <typename T, int D, int DV, bool INT8, int KV, typename OptIn, typename Run>
auto with_decode_pipeline(OptIn smem_optin, int group_rows, Run run) {
  constexpr int kDeep = KV ? DIFFX_DECODE_KV_STAGES : 2, kFew = KV ? 2 : 1, kWide = KV ? DIFFX_DECODE_KV_TILES : 1;
  using Wide = DecodeTileConfig<T, D, DV, INT8, kDeep, KV, kWide>;
  using Deep = DecodeTileConfig<T, D, DV, INT8, kDeep, KV>;
  const auto run_wide = [&] {
    if constexpr (KV != 0 && kWide == 2 && DIFFX_DECODE_KV_PACK_MAPS) {
      if (group_rows <= kDecodeRows / 2) return run(DecodePipeline<kDeep, kWide, true>{});
    }
    return run(DecodePipeline<kDeep, kWide>{});
  };
  if constexpr (Wide::kFitsEverywhere) {
    return run_wide();
  } else {
    const int optin = smem_optin();
    if (optin >= Wide::kSmemBytes) return run_wide();
    if constexpr (kWide == 1 || Deep::kFitsEverywhere) {
      if constexpr (kWide > 1) return run(DecodePipeline<kDeep, 1>{});
      else return run(DecodePipeline<kFew, 1>{});
    } else {
      return optin >= Deep::kSmemBytes ? run(DecodePipeline<kDeep, 1>{}) : run(DecodePipeline<kFew, 1>{});
    }
  }
}

#ifndef DIFFX_EMULATE
template <typename T, int D, int DV, bool INT8, int STAGES, int KV, int KT, bool PM>
cudaError_t launch_diff_attention_decode_pipeline(const KernelArgs& args, cudaStream_t stream) {
  using Cfg = DecodeTileConfig<T, D, DV, INT8, STAGES, KV, KT>;
  const auto kernel = diff_attention_decode_kernel<T, D, DV, INT8, STAGES, KV, KT, PM>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  unsigned dims[3];
  decode_grid(args, dims);
  kernel<<<dim3(dims[0], dims[1], dims[2]), kThreads, Cfg::kSmemBytes, stream>>>(args);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  cudaLaunchConfig_t merge = {};
  merge.gridDim = dim3(unsigned(args.p.num_heads), unsigned(args.p.batch), unsigned(args.p.q_len));
  merge.blockDim = dim3(kMergeThreads);
  merge.dynamicSmemBytes = kMergeSmemBytes;
  merge.stream = stream;
  cudaLaunchAttribute early[1] = {};
  early[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early[0].val.programmaticStreamSerializationAllowed = 1;
  if (DIFFX_DECODE_PDL && device_launches_dependents_early()) {
    merge.attrs = early;
    merge.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&merge, diff_attention_decode_merge_kernel<T, DV>, args);
}

// The first pipeline that fits this GPU (with_decode_pipeline).
template <typename T, int D, int DV, bool INT8, int KV = 0>
cudaError_t launch_diff_attention_decode(const KernelArgs& args, cudaStream_t stream) {
  return with_decode_pipeline<T, D, DV, INT8, KV>(
      device_smem_optin, args.plan.heads_per_cta * args.p.q_len, [&](auto pipe) {
        using Pipe = decltype(pipe);
        return launch_diff_attention_decode_pipeline<T, D, DV, INT8, Pipe::kStages, KV, Pipe::kKeyTiles,
                                                     Pipe::kPackedMaps>(args, stream);
      });
}

#endif  // DIFFX_EMULATE

}  // namespace diffx
