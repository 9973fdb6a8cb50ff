/*
** fdpass.c -- descriptors over unix sockets (SCM_RIGHTS), for the
** forkserver, the workers' reports and the channels.  Received descriptors
** are close-on-exec from the start; a truncated control message
** (MSG_CTRUNC: the receiver ran out of descriptors, or too many came) is an
** error, never a silent loss.
*/
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mp.h"

/* Room for a control message of MP_MAXFDS descriptors, aligned for it. */
typedef union Control {
  char buf[CMSG_SPACE(sizeof(int) * MP_MAXFDS)];
  struct cmsghdr align;
} Control;

/* A message of the one buffer 'buf', no control message yet. */
static void init_msg(struct msghdr *mh, struct iovec *iov, void *buf,
                     size_t len) {
  memset(mh, 0, sizeof *mh);
  iov->iov_base = buf;
  iov->iov_len = len;
  mh->msg_iov = iov;
  mh->msg_iovlen = 1;
}

ssize_t mp_sendfds(int sock, const void *buf, size_t len,
                   const int *fds, size_t nfds, int flags) {
  struct msghdr mh;
  struct iovec iov;
  Control u;
  ssize_t k;
  if (nfds > MP_MAXFDS) return -EINVAL;
  init_msg(&mh, &iov, (void *)(uintptr_t)buf, len);
  if (nfds > 0) {
    struct cmsghdr *c;
    memset(&u, 0, sizeof u);
    mh.msg_control = u.buf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  do k = sendmsg(sock, &mh, flags | MSG_NOSIGNAL);
  while (k < 0 && errno == EINTR);
  return k < 0 ? -errno : k;
}

ssize_t mp_recvfds(int sock, void *buf, size_t len,
                   int *fds, size_t maxfds, size_t *nfds, int flags) {
  struct msghdr mh;
  struct iovec iov;
  Control u;
  struct cmsghdr *c;
  ssize_t k;
  size_t i;
  *nfds = 0;
  init_msg(&mh, &iov, buf, len);
  mh.msg_control = u.buf;
  mh.msg_controllen = sizeof u.buf;
  do k = recvmsg(sock, &mh, flags | MSG_CMSG_CLOEXEC);
  while (k < 0 && errno == EINTR);
  if (k < 0) return -errno;
  for (c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      int *in = (int *)(void *)CMSG_DATA(c);
      for (i = 0; i < n; i++) {
        if (*nfds < maxfds) fds[(*nfds)++] = in[i];
        else close(in[i]);
      }
    }
  }
  if (mh.msg_flags & MSG_CTRUNC) {
    for (i = 0; i < *nfds; i++) close(fds[i]);
    *nfds = 0;
    return -EPROTO;
  }
  return k;
}
