/*
** floor_fdpass.c -- the floor for sending an already shared 256 MiB buffer:
** a memfd of that size, re-sent by descriptor passing (SCM_RIGHTS) over a
** socketpair; the child maps it, reads one byte, unmaps, closes the
** descriptor and replies with that byte.  Per round trip in microseconds.
**
**   floor_fdpass REPS SENDS MIB
** {"bench":"floor_fdpass","mib":MIB,"samples":[us per send,...]}
*/
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

static void send_fd(int sock, int fd) {
  char c = 'f';
  struct iovec iov = { &c, 1 };
  union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
  struct msghdr m;
  struct cmsghdr *cm;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov; m.msg_iovlen = 1;
  m.msg_control = u.buf; m.msg_controllen = sizeof u.buf;
  cm = CMSG_FIRSTHDR(&m);
  cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  if (sendmsg(sock, &m, 0) != 1) { perror("sendmsg"); exit(1); }
}

static int recv_fd(int sock) {   /* -1 on EOF */
  char c;
  struct iovec iov = { &c, 1 };
  union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } u;
  struct msghdr m;
  struct cmsghdr *cm;
  int fd;
  ssize_t k;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov; m.msg_iovlen = 1;
  m.msg_control = u.buf; m.msg_controllen = sizeof u.buf;
  do k = recvmsg(sock, &m, MSG_CMSG_CLOEXEC); while (k < 0 && errno == EINTR);
  if (k <= 0) return -1;
  cm = CMSG_FIRSTHDR(&m);
  if (!cm) return -1;
  memcpy(&fd, CMSG_DATA(cm), sizeof(int));
  return fd;
}

int main(int argc, char **argv) {
  int reps = arg_int(argc, argv, 1, 5);
  int sends = arg_int(argc, argv, 2, 500);
  size_t size = (size_t)arg_int(argc, argv, 3, 256) * 1024 * 1024;
  int sv[2], fd, r, i, st;
  double *s = malloc(sizeof(double) * (size_t)reps);
  unsigned char *p;
  pid_t pid;

  fd = memfd_create("bench", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) { perror("memfd"); return 1; }
  p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) { perror("mmap"); return 1; }
  p[0] = 42;
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) { perror("socketpair"); return 1; }
  pid = fork();
  if (pid == 0) {
    int f;
    close(sv[0]);
    while ((f = recv_fd(sv[1])) >= 0) {
      unsigned char *q = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
      unsigned char b;
      if (q == MAP_FAILED) _exit(1);
      b = q[0];
      munmap(q, size);
      close(f);
      if (write(sv[1], &b, 1) != 1) _exit(1);
    }
    _exit(0);
  }
  close(sv[1]);
  for (r = -1; r < reps; r++) {
    double t0 = now_s();
    for (i = 0; i < sends; i++) {
      unsigned char b;
      send_fd(sv[0], fd);
      if (read(sv[0], &b, 1) != 1 || b != 42) { fprintf(stderr, "bad reply\n"); return 1; }
    }
    if (r >= 0) s[r] = (now_s() - t0) * 1e6 / sends;
  }
  close(sv[0]);
  waitpid(pid, &st, 0);
  printf("{\"bench\":\"floor_fdpass\",\"mib\":%d,", (int)(size >> 20));
  print_samples(s, reps);
  return 0;
}
