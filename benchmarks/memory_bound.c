// A model of mpijax's node-local cross-memory all-reduce with nothing else
// around it: no XLA, no MPI, no Python. P processes with T threads each
// (members), every member with its own input and output of NBYTES, 2 MiB
// aligned and on transparent huge pages, as mpijax-run's heap gives XLA.
//
// flat (mpijax's algorithm): member m reduces block m (1/(P*T) of the
// message) in 1 MiB chunks: the first other member's chunk read straight
// into its output (its own input copied there when in place), the others
// added in (same process: straight from memory; other process:
// process_vm_readv into a scratch chunk), then the block written into every
// other member's output (memcpy or process_vm_writev).
//
// two-level (out of place, P and T >= 2): member t of each process first sums
// slice t (1/T) of its process's inputs into its own output, in one pass;
// after a barrier, member (p, t) reads part p of slice t of the other
// processes' sums (process_vm_readv), adds them, and writes the finished part
// into every other member's output. Less memory traffic than flat from 2 x 2
// on, one more barrier.
//
// The barriers spin and yield, as mpijax's waits do where ranks share cores.
// Prints one JSON line: the 10th, 50th and 90th percentiles (us), over ITERS
// steps, of member 0's step as a blocking call sees it (from its arrival to
// its departure; in a loop, the time per all-reduce), and of the part
// between the barriers (from the moment member 0 sees every member arrived:
// with more members than cores it may see that late, so this part alone
// leaves out work that others did meanwhile). Built and run by
// benchmarks/memory_bound.py.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_MEMBERS 16
#define MAX_ITERS 100000
#define CHUNK_BYTES (1u << 20)

typedef struct {
  _Atomic long ready;
  char pad0[120];
  _Atomic long arrive;
  char pad2[120];
  _Atomic long depart;
  char pad3[120];
  _Atomic long middle;
  char pad4[120];
  pid_t pid[MAX_MEMBERS];
  float *in[MAX_MEMBERS], *out[MAX_MEMBERS];
  double call_s[MAX_ITERS], reduce_s[MAX_ITERS];
} Shared;

static Shared* S;
static int P, T, M, IN_PLACE, ITERS, TWO_LEVEL;
static size_t NBYTES;

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void Barrier(_Atomic long* count, long target) {
  atomic_fetch_add(count, 1);
  for (int spin = 0; atomic_load(count) < target;)
    if (++spin > 200) sched_yield(), spin = 0;
}

static void Add(float* restrict io, const float* restrict in, size_t n) {
  for (size_t i = 0; i < n; i++) io[i] += in[i];
}

static int ProcOf(int m) { return m / T; }

static void Read(int m, float* to, const float* from, size_t bytes) {
  struct iovec here = {to, bytes}, there = {(void*)from, bytes};
  if (process_vm_readv(S->pid[ProcOf(m)], &here, 1, &there, 1, 0) !=
      (ssize_t)bytes) {
    perror("process_vm_readv");
    _exit(2);
  }
}

static void Write(int m, float* to, const float* from, size_t bytes) {
  struct iovec here = {(void*)from, bytes}, there = {to, bytes};
  if (process_vm_writev(S->pid[ProcOf(m)], &here, 1, &there, 1, 0) !=
      (ssize_t)bytes) {
    perror("process_vm_writev");
    _exit(2);
  }
}

static void* Member(void* arg) {
  int m = (int)(intptr_t)arg, me = ProcOf(m);
  size_t n = NBYTES / 4, chunk = CHUNK_BYTES / 4;
  float* tmp = aligned_alloc(4096, CHUNK_BYTES);
  memset(tmp, 0, CHUNK_BYTES);
  size_t lo = n * m / M, hi = n * (m + 1) / M;
  for (int it = 0; it < ITERS; it++) {
    double t0 = Now();
    Barrier(&S->arrive, (long)M * (it + 1));
    double t1 = Now();
    for (size_t at = lo; at < hi; at += chunk) {
      size_t cnt = hi - at < chunk ? hi - at : chunk, bytes = cnt * 4;
      float* acc = S->out[m] + at;
      int first = IN_PLACE ? m : (m == 0 ? 1 : 0);
      if (first == m) {
        if (S->in[m] != S->out[m]) memcpy(acc, S->in[m] + at, bytes);
      } else if (ProcOf(first) == me) {
        memcpy(acc, S->in[first] + at, bytes);
      } else {
        Read(first, acc, S->in[first] + at, bytes);
      }
      for (int j = 0; j < M; j++) {
        if (j == first) continue;
        if (ProcOf(j) == me) {
          Add(acc, S->in[j] + at, cnt);
        } else {
          Read(j, tmp, S->in[j] + at, bytes);
          Add(acc, tmp, cnt);
        }
      }
      for (int j = 0; j < M; j++) {
        if (j == m) continue;
        if (ProcOf(j) == me)
          memcpy(S->out[j] + at, acc, bytes);
        else
          Write(j, S->out[j] + at, acc, bytes);
      }
    }
    Barrier(&S->depart, (long)M * (it + 1));
    double t2 = Now();
    if (m == 0) S->call_s[it] = t2 - t0, S->reduce_s[it] = t2 - t1;
  }
  free(tmp);
  return NULL;
}

static void* MemberTwoLevel(void* arg) {
  int m = (int)(intptr_t)arg, me = ProcOf(m), t = m % T, first = me * T;
  size_t n = NBYTES / 4, chunk = CHUNK_BYTES / 4;
  float* tmp = aligned_alloc(4096, CHUNK_BYTES);
  memset(tmp, 0, CHUNK_BYTES);
  // Slice t of the message; part `me` of it.
  size_t lo = n * t / T, hi = n * (t + 1) / T;
  size_t plo = lo + (hi - lo) * me / P, phi = lo + (hi - lo) * (me + 1) / P;
  float* acc = S->out[m];
  for (int it = 0; it < ITERS; it++) {
    double t0 = Now();
    Barrier(&S->arrive, (long)M * (it + 1));
    double t1 = Now();
    for (size_t at = lo; at < hi; at += chunk) {
      size_t cnt = hi - at < chunk ? hi - at : chunk;
      const float *a = S->in[first] + at, *b = S->in[first + 1] + at;
      for (size_t i = 0; i < cnt; i++) acc[at + i] = a[i] + b[i];
      for (int j = 2; j < T; j++) Add(acc + at, S->in[first + j] + at, cnt);
    }
    Barrier(&S->middle, (long)M * (it + 1));
    for (size_t at = plo; at < phi; at += chunk) {
      size_t cnt = phi - at < chunk ? phi - at : chunk, bytes = cnt * 4;
      for (int q = 0; q < P; q++) {
        if (q == me) continue;
        Read(q * T + t, tmp, S->out[q * T + t] + at, bytes);
        Add(acc + at, tmp, cnt);
      }
      for (int j = 0; j < M; j++) {
        if (j == m) continue;
        if (ProcOf(j) == me)
          memcpy(S->out[j] + at, acc + at, bytes);
        else
          Write(j, S->out[j] + at, acc + at, bytes);
      }
    }
    Barrier(&S->depart, (long)M * (it + 1));
    double t2 = Now();
    if (m == 0) S->call_s[it] = t2 - t0, S->reduce_s[it] = t2 - t1;
  }
  free(tmp);
  return NULL;
}

static float* Alloc(size_t bytes) {
  float* p = aligned_alloc(2u << 20, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  memset(p, 0, bytes);
  return p;
}

static int Cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static void Quantiles(double* v, int n, double q[3]) {
  qsort(v, n, sizeof *v, Cmp);
  q[0] = v[n / 10] * 1e6, q[1] = v[n / 2] * 1e6, q[2] = v[n * 9 / 10] * 1e6;
}

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    fprintf(stderr,
            "usage: %s PROCS THREADS NBYTES IN_PLACE(0|1) ITERS "
            "[flat|two-level]\n",
            argv[0]);
    return 2;
  }
  P = atoi(argv[1]), T = atoi(argv[2]), NBYTES = strtoull(argv[3], 0, 10);
  IN_PLACE = atoi(argv[4]), ITERS = atoi(argv[5]);
  TWO_LEVEL = argc == 7 && strcmp(argv[6], "two-level") == 0;
  M = P * T;
  if (argc == 7 && !TWO_LEVEL && strcmp(argv[6], "flat") != 0) {
    fprintf(stderr, "memory_bound: the algorithm is flat or two-level\n");
    return 2;
  }
  if (TWO_LEVEL && (IN_PLACE || P < 2 || T < 2)) {
    fprintf(stderr, "memory_bound: two-level is out of place, with at least "
            "2 processes and 2 threads\n");
    return 2;
  }
  if (P < 1 || T < 1 || M < 2 || M > MAX_MEMBERS || NBYTES % 4 != 0 ||
      NBYTES < 4 * (size_t)M || ITERS < 10 || ITERS > MAX_ITERS) {
    fprintf(stderr, "memory_bound: 2 to %d members, NBYTES a multiple of 4 "
            "(at least 4 per member), 10 to %d iterations\n",
            MAX_MEMBERS, MAX_ITERS);
    return 2;
  }
  S = mmap(NULL, sizeof(Shared), PROT_READ | PROT_WRITE,
           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (S == MAP_FAILED) return perror("mmap"), 1;
  for (int p = 0; p < P; p++) {
    pid_t child = fork();
    if (child < 0) return perror("fork"), 1;
    if (child > 0) continue;
    S->pid[p] = getpid();
    for (int t = 0; t < T; t++) {
      int m = p * T + t;
      S->in[m] = Alloc(NBYTES);
      S->out[m] = IN_PLACE ? S->in[m] : Alloc(NBYTES);
      for (size_t i = 0; i < NBYTES / 4; i++)
        S->in[m][i] = (float)(m + 1);
    }
    Barrier(&S->ready, P);  // every process's buffers published
    pthread_t threads[MAX_MEMBERS];
    for (int t = 0; t < T; t++)
      pthread_create(&threads[t], NULL, TWO_LEVEL ? MemberTwoLevel : Member,
                     (void*)(intptr_t)(p * T + t));
    for (int t = 0; t < T; t++) pthread_join(threads[t], NULL);
    // Out of place the inputs stay m + 1, so the sums are exact: 1 + ... + M.
    int bad = 0;
    if (!IN_PLACE) {
      float want = (float)M * (M + 1) / 2;
      for (int t = 0; t < T; t++) {
        const float* o = S->out[p * T + t];
        for (size_t i = 0; i < NBYTES / 4; i++) bad |= o[i] != want;
      }
    }
    _exit(bad ? 3 : 0);
  }
  int failed = 0;
  for (int p = 0; p < P; p++) {
    int status = 0;
    wait(&status);
    failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
  }
  if (failed) {
    fprintf(stderr, "memory_bound: a process failed or summed wrong\n");
    return 1;
  }
  double c[3], r[3];
  Quantiles(S->call_s, ITERS, c);
  Quantiles(S->reduce_s, ITERS, r);
  printf("{\"procs\": %d, \"threads\": %d, \"bytes\": %zu, \"in_place\": %d, "
         "\"algorithm\": \"%s\", \"iters\": %d, \"call_us\": [%.1f, %.1f, %.1f], "
         "\"between_barriers_us\": [%.1f, %.1f, %.1f]}\n",
         P, T, NBYTES, IN_PLACE, TWO_LEVEL ? "two-level" : "flat", ITERS, c[0],
         c[1], c[2], r[0], r[1], r[2]);
  return 0;
}
