// Disk-tier read paths compared on one file of fixed slots (docs/benchmarks.md,
// "Storage tiers"): O_DIRECT pread of one slot at a time (what DiskStore
// does), and io_uring (liburing) O_DIRECT reads of the same slots at queue
// depth 1 and 8. Not part of the build:
//   cc -O2 -o /tmp/uring_read bench/uring_read.c -luring   (Debian liburing-dev)
//   /tmp/uring_read FILE SLOT_BYTES
#define _GNU_SOURCE
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static double uring_pass(int fd, long slot, long n, int qd, char** bufs) {
  struct io_uring ring;
  if (io_uring_queue_init(qd, &ring, 0) != 0) return -1;
  const double t0 = now();
  long submitted = 0, done = 0;
  while (done < n) {
    while (submitted < n && submitted - done < qd) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      io_uring_prep_read(sqe, fd, bufs[submitted % qd], slot, submitted * slot);
      ++submitted;
    }
    io_uring_submit(&ring);
    struct io_uring_cqe* cqe;
    if (io_uring_wait_cqe(&ring, &cqe) != 0 || cqe->res != slot) return -1;
    io_uring_cqe_seen(&ring, cqe);
    ++done;
  }
  const double t = now() - t0;
  io_uring_queue_exit(&ring);
  return t;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s FILE SLOT_BYTES\n", argv[0]);
    return 2;
  }
  const long slot = atol(argv[2]);
  const int fd = open(argv[1], O_RDONLY | O_DIRECT);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || slot <= 0 || slot % 4096) return 1;
  const long n = st.st_size / slot;
  char* bufs[8];
  for (int i = 0; i < 8; ++i) {
    if (posix_memalign((void**)&bufs[i], 4096, slot) != 0) return 1;
  }
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = now();
    for (long i = 0; i < n; ++i) {
      if (pread(fd, bufs[0], slot, i * slot) != slot) return 1;
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  printf("pread O_DIRECT qd1   %.2f GB/s\n", n * slot / best / 1e9);
  for (int qd = 1; qd <= 8; qd *= 8) {
    best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const double t = uring_pass(fd, slot, n, qd, bufs);
      if (t < 0) return 1;
      if (t < best) best = t;
    }
    printf("io_uring O_DIRECT qd%d %.2f GB/s\n", qd, n * slot / best / 1e9);
  }
  return 0;
}
