/*
 * The NCCL baseline loader (src/ref/ref_nccl.c) without a GPU: libnccl loads (or the
 * reason it does not is given), and a request NCCL cannot serve (two ranks on one GPU)
 * is refused with a message before any NCCL call. Skips (77) where libnccl is absent.
 */
#include <string.h>

#include "ref/ref_nccl.h"
#include "tw_test.h"

int main(void) {
  char why[256] = "";
  if (!tw_ref_nccl_available(why, sizeof(why))) {
    TEST_ASSERT(strlen(why) > 0 && strstr(why, "TW_NCCL_LIB") != NULL,
                "unavailable without a reason naming TW_NCCL_LIB: \"%s\"", why);
    printf("SKIP: %s\n", why);
    return tw_test_failed ? 1 : 77;
  }
  printf("libnccl loaded\n");
  tw_ref_nccl_t *nccl = (tw_ref_nccl_t *)1;
  int devices[3] = {0, 1, 0};
  TEST_ASSERT(tw_ref_nccl_create(&nccl, 3, devices, why, sizeof(why)) != 0,
              "duplicate GPUs accepted");
  TEST_ASSERT(nccl == NULL, "output not cleared on failure");
  TEST_ASSERT(strstr(why, "ranks 0 and 2 share GPU 0") != NULL, "message: %s", why);
  TEST_ASSERT(tw_ref_nccl_create(&nccl, 0, devices, why, sizeof(why)) != 0, "world 0 accepted");
  TEST_ASSERT(strstr(why, "world 0") != NULL, "message: %s", why);
  return tw_test_finish();
}
