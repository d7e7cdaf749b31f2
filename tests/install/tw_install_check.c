/*
 * Built against an installed tilewire (tests/install/run.sh): the header compiles alone (no
 * CUDA header) and the library loads and answers without a GPU.
 */
#include <stdio.h>
#include <string.h>

#include <tilewire.h>

int main(void) {
  const int version = tw_version();
  const char *ok = tw_status_string(TW_SUCCESS);
  const char *bad = tw_status_string(TW_ERR_INVALID_ARGUMENT);
  if (version != TW_VERSION_CODE || !ok || !bad || strcmp(ok, bad) == 0) {
    fprintf(stderr, "tw_version() %d, header %d; \"%s\", \"%s\"\n", version, TW_VERSION_CODE,
            ok ? ok : "(null)", bad ? bad : "(null)");
    return 1;
  }
  printf("tilewire %d.%d.%d: %s\n", TW_VERSION_MAJOR, TW_VERSION_MINOR, TW_VERSION_PATCH, bad);
  return 0;
}
