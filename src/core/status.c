#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[TW_ERRMSG_LEN];

const char *tw_status_string(tw_status_t status) {
  switch (status) {
  case TW_SUCCESS: return "TW_SUCCESS: no error";
  case TW_ERR_INVALID_ARGUMENT: return "TW_ERR_INVALID_ARGUMENT: invalid argument";
  case TW_ERR_NO_DEVICE: return "TW_ERR_NO_DEVICE: no CUDA driver or device";
  case TW_ERR_UNSUPPORTED_DEVICE: return "TW_ERR_UNSUPPORTED_DEVICE: GPU is not sm_90 (Hopper)";
  case TW_ERR_CUDA: return "TW_ERR_CUDA: a CUDA call failed";
  case TW_ERR_OUT_OF_MEMORY: return "TW_ERR_OUT_OF_MEMORY: out of device or heap memory";
  case TW_ERR_SYSTEM: return "TW_ERR_SYSTEM: a system call failed";
  case TW_ERR_TIMEOUT: return "TW_ERR_TIMEOUT: a host-side wait timed out";
  case TW_ERR_REMOTE: return "TW_ERR_REMOTE: another rank failed";
  case TW_ERR_DEVICE_TIMEOUT: return "TW_ERR_DEVICE_TIMEOUT: a wait inside a kernel timed out";
  case TW_ERR_NOT_SUPPORTED: return "TW_ERR_NOT_SUPPORTED: not supported";
  case TW_ERR_INTERNAL: return "TW_ERR_INTERNAL: internal error";
  case TW_ERR_ABORTED: return "TW_ERR_ABORTED: kernel aborted after another rank's timeout";
  case TW_ERR_MISMATCH: return "TW_ERR_MISMATCH: ranks disagree on a collective call";
  case TW_ERR_NETWORK: return "TW_ERR_NETWORK: an RDMA transfer failed or a peer stopped answering";
  }
  return "TW_ERR_UNKNOWN: unknown status code";
}

const char *tw_last_error(void) { return last_error; }

int tw_version(void) { return TW_VERSION_CODE; }

tw_status_t tw_fail(tw_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  va_end(ap);
  return status;
}

void tw_error_prefix(const char *fmt, ...) {
  char prefix[TW_ERRMSG_LEN];
  char old[TW_ERRMSG_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof(prefix), fmt, ap);
  va_end(ap);
  memcpy(old, last_error, sizeof(old));
  size_t n = strnlen(prefix, sizeof(prefix) - 3);
  memcpy(last_error, prefix, n);
  memcpy(last_error + n, ": ", 2);
  size_t room = sizeof(last_error) - n - 3;
  size_t m = strnlen(old, room);
  memcpy(last_error + n + 2, old, m);
  last_error[n + 2 + m] = '\0';
}

void tw_error_clear(void) { last_error[0] = '\0'; }

void tw_error_copy(char *dst) { memcpy(dst, last_error, TW_ERRMSG_LEN); }
