/* Splitting an op's work over threads (see "splitting work over threads" in common.h): one
 * OpenMP region per call for the standalone entry points (run_parallel), and, for the fused
 * decode stack's one region per step (decode.c), the team primitives: a shared counter hands
 * out chunks, and a barrier spins for a few microseconds and then yields the core.
 *
 * Why our own barrier: libgomp's either spin for milliseconds (its default: on a machine shared
 * with other processes a preempted thread then stalls every op, and the spinning threads take
 * the CPU it needs) or sleep at once (OMP_WAIT_POLICY=PASSIVE: every region then pays a
 * wake-up), and a decode step at batch 1 has ~300 of them. */
#include <sched.h>

#include "common.h"

#define BARRIER_SPIN_NS 3000 /* spin this long at a barrier before yielding the core */
#define BARRIER_CLOCK_EVERY 64 /* spins between clock reads */

void run_parallel(const void* args, range_fn fn, int64_t items, int64_t chunk, int nthreads) {
    const int64_t chunks = (items + chunk - 1) / chunk;
    if (nthreads <= 1 || chunks <= 1) {
        if (items > 0) fn(args, 0, items);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < chunks; c++) fn(args, c * chunk, min64(items, (c + 1) * chunk));
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void team_sync(mg_team* team) {
    if (team->size == 1) return;
    mg_barrier* b = team->barrier;
    const int generation = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == team->size - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_release);
        return;
    }
    int64_t spin_until = 0;
    for (int64_t spins = 0;
         atomic_load_explicit(&b->generation, memory_order_acquire) == generation; spins++) {
        if (spins % BARRIER_CLOCK_EVERY == 0) {
            const int64_t t = now_ns();
            if (spin_until == 0) spin_until = t + BARRIER_SPIN_NS;
            if (t > spin_until) {
                sched_yield();
                continue;
            }
        }
        cpu_relax();
    }
}

int team_run(mg_team* team, const void* args, range_fn fn, int64_t items, int64_t chunk) {
    if (team->next_counter >= team->num_counters) return 1;
    atomic_llong* counter = &team->counters[team->next_counter++];
    for (;;) {
        const int64_t begin = atomic_fetch_add_explicit(counter, chunk, memory_order_relaxed);
        if (begin >= items) break;
        fn(args, begin, min64(items, begin + chunk));
    }
    team_sync(team);
    return 0;
}
