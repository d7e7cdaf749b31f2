/*
 * Which NICs a rank takes (transport/net.c, tw_net_pick_nearest) on sysfs paths of the shapes real
 * hosts have: the NIC under the GPU's own PCIe switch on a ConnectX node (one a GPU), both NICs
 * under it on a p5 (two EFA a GPU), the socket's NICs before the other socket's, and without any
 * topology (the test double, a container without sysfs) a share by local rank.
 */
#include <string.h>

#include "tw_test.h"

#ifndef TW_VERBS_DOUBLE
int main(void) {
  printf("built without rdma-core's headers: no NIC choice to test\n");
  return 77;
}
#else
#include "transport/net_impl.h"

#define ROOT0 "/sys/devices/pci0000:00/0000:00:01.0"
#define ROOT1 "/sys/devices/pci0000:80/0000:80:01.0"

static int pick(const char *gpu, const char *const *nics, int n, int local, int size, int *out) {
  return tw_net_pick_nearest(gpu, nics, n, local, size, out, TW_NET_MAX_NICS);
}

int main(void) {
  int out[TW_NET_MAX_NICS];
  /* one NIC per GPU, each pair under its switch */
  const char *cx7[] = {ROOT0 "/0000:01:00.0/0000:02:00.0/0000:03:00.0",
                       ROOT0 "/0000:01:00.0/0000:02:01.0/0000:04:00.0",
                       ROOT1 "/0000:81:00.0/0000:82:00.0/0000:83:00.0",
                       ROOT1 "/0000:81:00.0/0000:82:01.0/0000:84:00.0"};
  int n = pick(ROOT0 "/0000:01:00.0/0000:02:01.0/0000:05:00.0", cx7, 4, 1, 4, out);
  TEST_ASSERT(n == 1 && out[0] == 1, "the GPU's own switch: %d NICs, first %d", n, out[0]);
  n = pick(ROOT1 "/0000:81:00.0/0000:82:00.0/0000:85:00.0", cx7, 4, 2, 4, out);
  TEST_ASSERT(n == 1 && out[0] == 2, "the other socket's GPU: %d NICs, first %d", n, out[0]);
  /* a p5: two EFA NICs under the GPU's switch */
  const char *p5[] = {ROOT0 "/0000:01:00.0/0000:02:00.0/0000:10:00.0",
                      ROOT0 "/0000:01:00.0/0000:02:00.0/0000:11:00.0",
                      ROOT0 "/0000:01:00.0/0000:02:04.0/0000:12:00.0",
                      ROOT0 "/0000:01:00.0/0000:02:04.0/0000:13:00.0"};
  n = pick(ROOT0 "/0000:01:00.0/0000:02:04.0/0000:14:00.0", p5, 4, 1, 2, out);
  TEST_ASSERT(n == 2 && out[0] == 2 && out[1] == 3, "p5: %d NICs (%d, %d)", n, out[0], out[1]);
  /* no switch in common: the NICs of the GPU's root complex */
  const char *sockets[] = {ROOT1 "/0000:81:00.0/0000:83:00.0", ROOT0 "/0000:01:00.0/0000:03:00.0"};
  n = pick(ROOT0 "/0000:05:00.0/0000:06:00.0", sockets, 2, 0, 1, out);
  TEST_ASSERT(n == 1 && out[0] == 1, "same root complex: %d NICs, first %d", n, out[0]);
  /* a NIC whose path is unknown is never nearer than a known one */
  const char *partly[] = {NULL, ROOT1 "/0000:81:00.0/0000:83:00.0"};
  n = pick(ROOT0 "/0000:05:00.0", partly, 2, 0, 1, out);
  TEST_ASSERT(n == 1 && out[0] == 1, "an unknown path: %d NICs, first %d", n, out[0]);
  /* no topology: 8 NICs over 4 local ranks, two each, in order; 2 over 4, one each, shared */
  const char *none[8] = {NULL};
  for (int l = 0; l < 4; l++) {
    n = pick(NULL, none, 8, l, 4, out);
    TEST_ASSERT(n == 2 && out[0] == 2 * l && out[1] == 2 * l + 1, "share of 8 by local %d: %d", l,
                n);
    n = pick(NULL, none, 2, l, 4, out);
    TEST_ASSERT(n == 1 && out[0] == l % 2, "share of 2 by local %d: %d NICs, first %d", l, n,
                out[0]);
  }
  n = pick(NULL, none, 0, 0, 1, out);
  TEST_ASSERT(n == 0, "no candidate: %d", n);
  return tw_test_finish();
}
#endif
