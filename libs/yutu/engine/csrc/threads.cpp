// Where torch's intra-op (OpenMP) threads run during a wide step (yutu/engine/engine.py).
//
// On a 2-CPU host a wide step's two threads that start on the same CPU (the other one busy with
// another engine's step at that moment) can stay there after the other CPU frees up: at every
// barrier one sleeps as the other wakes, the waker's CPU is where the scheduler puts the wakee, and
// the load balancer never sees two runnable threads on one CPU to spread (perf sched: 24 ms of one
// CPU idle while both threads of a step alternated on the other, the step 4x as long). Binding
// each thread of the team to its own CPU for the step's duration rules that out.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <sched.h>

#include <vector>

namespace {

cpu_set_t saved;     // the calling thread's CPUs before spread_threads(true)
bool spread = false;  // whether the team is bound now

void bind_team(const std::vector<cpu_set_t>& sets) {
  const int64_t n = at::get_num_threads();
  // one item per thread of the team: at::parallel_for gives thread t the item t (grain 1, n items)
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sched_setaffinity(0, sizeof(cpu_set_t), &sets[t % sets.size()]);
  });
}

}  // namespace

bool spread_threads(bool on) {
  if (on == spread) return true;
  if (!on) {
    bind_team({saved});
    sched_setaffinity(0, sizeof saved, &saved);  // the calling thread (the team's thread 0) too
    spread = false;
    return true;
  }
  if (sched_getaffinity(0, sizeof saved, &saved) != 0) return false;
  const int here = sched_getcpu();
  std::vector<cpu_set_t> sets;  // the CPU this thread is on first, then the other allowed ones
  for (int pass = 0; pass < 2; ++pass) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (!CPU_ISSET(cpu, &saved) || (pass == 0) != (cpu == here)) continue;
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      sets.push_back(one);
    }
  }
  if (sets.size() < 2) return false;  // one CPU (or sched_getcpu failed): nothing to spread over
  spread = true;
  bind_team(sets);
  return true;
}
