// Host-side check of the Hopper path's layout facts (no GPU: CuTe's layout algebra runs on the CPU).
// The wgmma kernel cannot be emulated here, but everything its hand-written index arithmetic assumes
// about CuTe's layouts can be compared with CuTe itself, for every instantiation:
//   1. acc_row/acc_col give the row and column CuTe assigns to each accumulator value, for S (64 x 64)
//      and O (64 x DV), for all 128 threads of a consumer warpgroup;
//   2. the register A operand of the P.V wgmma holds, value for value, the same (row, key) as S's
//      accumulator, so converting S in place is P;
//   3. SmemLayoutVt(dv, key, stage) addresses the same element as SmemLayoutV(key, dv, stage);
//   4. the TMA transaction bytes per stage and for Q are what the tiles hold;
//   5. INT8 logits: the s8 wgmma's int32 accumulator has the fp32 one's layout (the kernel
//      dequantises it value for value into S), and its K tiles and Q codes are int8;
//   6. the key mask's bit of each S value (acc_key_shift, acc_col(0, i)) is the key CuTe gives it;
//   7. both maps a warpgroup (DIFFX_SM90_MAPS_PER_WARPGROUP=2, checked here beside the default):
//      where it applies (head dim 64, fp logits; a static_assert) 128 query rows a CTA over 64-key
//      tiles, Q's four 64-row tiles counted in its TMA bytes, at least three stages.
// tests/test_kernel_build.py compiles it with nvcc (host code only) and runs it; exit status 0 when
// every fact holds, 1 with the first mismatches printed otherwise.
#include <cstdarg>
#include <cstdio>

#include "diff_attention_sm90_config.cuh"

using namespace cute;
using namespace diffx::sm90;

namespace {

int failures = 0;

void fail(const char* fmt, ...) {
  if (++failures > 10) return;
  std::va_list args;
  va_start(args, fmt);
  std::printf("MISMATCH ");
  std::vprintf(fmt, args);
  std::printf("\n");
  va_end(args);
}

template <typename Element, int D, int DV, bool INT8, int MAPS = 1>
void check(const char* dtype) {
  using Cfg = Config<Element, D, DV, INT8, MAPS>;
  using Keys = typename Cfg::KeyBlock;
  constexpr int kKeys = Cfg::kKeyBlock;
  // S's fp32 wgmma over the same tile, for INT8's int32 accumulator to be compared with.
  using FpMmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Keys, Int<D>>>()));
  typename Cfg::TiledMmaS mma_s;
  typename Cfg::TiledMmaO mma_o;
  static_assert(size(typename Cfg::TiledMmaS{}) == cutlass::NumThreadsPerWarpGroup, "one warpgroup per map");
  static_assert(size(typename Cfg::TiledMmaO{}) == cutlass::NumThreadsPerWarpGroup, "one warpgroup per map");
  int checked = 0;
  for (int tid = 0; tid < cutlass::NumThreadsPerWarpGroup; ++tid) {
    auto thr_s = mma_s.get_thread_slice(tid);
    auto thr_o = mma_o.get_thread_slice(tid);
    auto thr_fp = FpMmaS{}.get_thread_slice(tid);
    Tensor fp_coord = thr_fp.partition_C(make_identity_tensor(Shape<_64, Keys>{}));
    Tensor s_coord = thr_s.partition_C(make_identity_tensor(Shape<_64, Keys>{}));
    Tensor p_coord = thr_o.partition_A(make_identity_tensor(Shape<_64, Keys>{}));
    Tensor o_coord = thr_o.partition_C(make_identity_tensor(Shape<_64, Int<DV>>{}));
    if (size(s_coord) != kKeys / 2 || size(p_coord) != kKeys / 2 || size(o_coord) != DV / 2) {
      fail("fragment sizes (D %d, DV %d, %s): S %d, P %d, O %d values a thread; expected %d, %d, %d", D, DV, dtype,
           int(size(s_coord)), int(size(p_coord)), int(size(o_coord)), kKeys / 2, kKeys / 2, DV / 2);
      return;
    }
    for (int i = 0; i < size(s_coord); ++i) {
      const int row = get<0>(s_coord(i)), key = get<1>(s_coord(i));
      if (row != acc_row(tid, i) || key != acc_col(tid, i))
        fail("S accumulator (D %d, DV %d, %s): thread %d value %d: CuTe (%d, %d), acc_row/acc_col (%d, %d)", D, DV,
             dtype, tid, i, row, key, acc_row(tid, i), acc_col(tid, i));
      if (acc_key_shift(tid) + acc_col(0, i) != key || key >= kKeys)
        fail("key mask bit (D %d, DV %d, %s): thread %d value %d: key %d, bit %d after the shift %d of %d keys", D, DV,
             dtype, tid, i, key, acc_col(0, i), acc_key_shift(tid), kKeys);
      if (get<0>(fp_coord(i)) != row || get<1>(fp_coord(i)) != key)
        fail("S accumulator (D %d, DV %d, %s, INT8 %d): thread %d value %d: (%d, %d), the fp32 one (%d, %d)", D, DV,
             dtype, int(INT8), tid, i, row, key, int(get<0>(fp_coord(i))), int(get<1>(fp_coord(i))));
      if (get<0>(p_coord(i)) != row || get<1>(p_coord(i)) != key)
        fail("P operand (D %d, DV %d, %s): thread %d value %d: A operand (%d, %d), S accumulator (%d, %d)", D, DV,
             dtype, tid, i, int(get<0>(p_coord(i))), int(get<1>(p_coord(i))), row, key);
      ++checked;
    }
    for (int i = 0; i < size(o_coord); ++i) {
      const int row = get<0>(o_coord(i)), col = get<1>(o_coord(i));
      if (row != acc_row(tid, i) || col != acc_col(tid, i))
        fail("O accumulator (D %d, DV %d, %s): thread %d value %d: CuTe (%d, %d), acc_row/acc_col (%d, %d)", D, DV,
             dtype, tid, i, row, col, acc_row(tid, i), acc_col(tid, i));
      ++checked;
    }
  }
  typename Cfg::SmemLayoutV v;
  typename Cfg::SmemLayoutVt vt;
  for (int s = 0; s < Cfg::kStages; ++s)
    for (int key = 0; key < kKeys; ++key)
      for (int dv = 0; dv < DV; ++dv, ++checked)
        if (vt(dv, key, s) != v(key, dv, s))
          fail("V transposed view (D %d, DV %d, %s): Vt(%d, %d, %d) at %d, V(%d, %d, %d) at %d", D, DV, dtype, dv, key, s,
               int(vt(dv, key, s)), key, dv, s, int(v(key, dv, s)));
  const int key_bytes = INT8 ? 1 : int(sizeof(Element));
  static_assert(sizeof(typename Cfg::KElement) == (INT8 ? 1 : sizeof(Element)), "K tiles: int8 codes for INT8 logits");
  const int stage_bytes = Cfg::kKeyMaps * kKeys * D * key_bytes + kKeys * DV * int(sizeof(Element));
  if (int(Cfg::kStageBytes) != stage_bytes)
    fail("stage bytes (D %d, DV %d, %s): %d, the tiles hold %d", D, DV, dtype, int(Cfg::kStageBytes), stage_bytes);
  const bool both_maps = MAPS == 2 && D == 64 && !INT8;
  if (Cfg::kBothMaps != both_maps || Cfg::kBlockRows != (both_maps ? 2 : 1) * kBlockM)
    fail("maps a warpgroup (D %d, DV %d, %s, INT8 %d, MAPS %d): both %d, %d rows a CTA", D, DV, dtype, int(INT8), MAPS,
         int(Cfg::kBothMaps), Cfg::kBlockRows);
  if (both_maps && (kKeys != 64 || Cfg::kStages < 3))
    fail("both maps a warpgroup (D %d, DV %d, %s): %d stages of %d keys", D, DV, dtype, Cfg::kStages, kKeys);
  const int q_bytes = 2 * Cfg::kBlockRows * D * int(sizeof(Element));
  if (int(Cfg::kQBytes) != q_bytes)
    fail("Q bytes (D %d, DV %d, %s): %d, the tiles hold %d", D, DV, dtype, int(Cfg::kQBytes), q_bytes);
#if DIFFX_SM90_PERSISTENT
  // Persistent where the epilogue's own scratch fits beside 64-key tiles: V2, and V1 at head dim 64.
  if (Cfg::kKeyBlock == 64 && Cfg::kPersistent != (DV == D || D == 64))
    fail("persistent (D %d, DV %d, %s): %d", D, DV, dtype, int(Cfg::kPersistent));
#endif
  std::printf("D %3d DV %3d %s%s: %d facts, shared storage %zu bytes (%d stages of %d keys)%s%s\n", D, DV, dtype,
              INT8 ? " INT8" : "", checked, sizeof(typename Cfg::SharedStorage), Cfg::kStages, kKeys,
              Cfg::kPersistent ? ", persistent" : "", Cfg::kBothMaps ? ", both maps a warpgroup (128 rows)" : "");
}

template <typename Element>
void check_dtype(const char* dtype) {
  for (bool int8 : {false, true}) {
    (int8 ? check<Element, 64, 64, true> : check<Element, 64, 64, false>)(dtype);
    (int8 ? check<Element, 64, 128, true> : check<Element, 64, 128, false>)(dtype);
    (int8 ? check<Element, 128, 128, true> : check<Element, 128, 128, false>)(dtype);
    (int8 ? check<Element, 128, 256, true> : check<Element, 128, 256, false>)(dtype);
  }
}

// Both maps a warpgroup leaves head dim 128 and INT8 logits to the default tiles.
static_assert(!Config<cutlass::bfloat16_t, 128, 256, false, 2>::kBothMaps && !Config<cutlass::half_t, 128, 128, false, 2>::kBothMaps &&
              !Config<cutlass::bfloat16_t, 64, 128, true, 2>::kBothMaps && Config<cutlass::half_t, 64, 64, false, 2>::kBothMaps,
              "both maps a warpgroup: head dim 64, fp logits");

}  // namespace

int main() {
  check_dtype<cutlass::half_t>("fp16");
  check_dtype<cutlass::bfloat16_t>("bf16");
  // Both maps a warpgroup, in the configurations it changes (the layouts do not depend on which
  // 16-bit type: the timed one).
  check<cutlass::bfloat16_t, 64, 64, false, 2>("bf16");
  check<cutlass::bfloat16_t, 64, 128, false, 2>("bf16");
  std::printf(failures ? "FAILED: %d mismatches\n" : "all layout facts hold\n", failures);
  return failures ? 1 : 0;
}
