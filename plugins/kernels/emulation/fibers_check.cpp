// fibers.h on its own (tests/test_emulator_fibers.py builds it with each switch: the assembly one
// and -DDIFFX_EMU_FIBER_UCONTEXT=1). Prints one line per fact it checked and exits 0, or 1 at the
// first that does not hold. With the argument "deadlock", one fiber skips a barrier the others wait
// at: the run must abort with its one line.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fibers.h"

namespace {

int failures = 0;

void check(bool holds, const char* fact) {
  std::printf("%s %s\n", holds ? "ok" : "FAILED", fact);
  if (!holds) ++failures;
}

struct Shared {
  diffx_emu::FiberBarrier* block;
  std::vector<diffx_emu::FiberBarrier*> warps;  // one per 4 fibers
  std::vector<int> phase_of;                    // each fiber's phase, as the others see it
  std::vector<int> order;                        // the fibers in the order their first step ran
  bool barrier_kept = true;
  bool deadlock = false;
};

// A fiber's user data: its index's own word, which no other fiber may see change.
struct Own {
  int index;
  long long sum = 0;
};

void body(Shared& s, int t) {
  Own& own = *static_cast<Own*>(diffx_emu::t_fiber->user);
  s.order.push_back(t);
  char deep[8192];  // a frame that needs its own stack
  std::memset(deep, t, sizeof deep);
  for (int phase = 1; phase <= 50; ++phase) {
    s.phase_of[t] = phase;
    if (s.deadlock && t == 3 && phase == 7) return;  // leaves the others at the block barrier
    s.block->arrive_and_wait();
    for (int other : s.phase_of) s.barrier_kept &= other >= phase;  // everyone arrived before anyone left
    s.warps[t / 4]->arrive_and_wait();
    own.sum += phase + deep[phase];
  }
  own.index = t;
}

}  // namespace

int main(int argc, char** argv) {
  const bool deadlock = argc > 1 && std::string(argv[1]) == "deadlock";
  const int threads = 16;
  diffx_emu::Fibers fibers(threads);
  for (int run = 0; run < 3; ++run) {  // the stacks are reused: a second and third run start afresh
    const bool descending = run == 1;
    Shared s;
    s.deadlock = deadlock;
    diffx_emu::FiberBarrier block(threads);
    std::vector<diffx_emu::FiberBarrier> warps(threads / 4, diffx_emu::FiberBarrier(4));
    s.block = &block;
    for (auto& w : warps) s.warps.push_back(&w);
    s.phase_of.assign(threads, 0);
    std::vector<Own> own(threads);
    std::vector<void*> users;
    for (auto& o : own) users.push_back(&o);
    auto fn = [&](int t) { body(s, t); };
    fibers.run(users.data(), fn, descending);
    check(s.barrier_kept, "no fiber left a barrier before every fiber had arrived");
    bool sums = true;
    for (int t = 0; t < threads; ++t) sums &= own[t].index == t && own[t].sum == 50 * 51 / 2 + 50 * (signed char)t;
    check(sums, "each fiber's own data and stack frame kept their values across the switches");
    check(s.order.size() == size_t(threads) && s.order.front() == (descending ? threads - 1 : 0),
          descending ? "descending: the highest fiber ran first" : "ascending: the lowest fiber ran first");
    check(diffx_emu::t_fiber == nullptr, "the scheduling thread is no fiber after a run");
  }
  return failures == 0 ? 0 : 1;
}
