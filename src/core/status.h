/* Status strings, the thread-local last-error message, check macros. */
#ifndef TW_CORE_STATUS_H
#define TW_CORE_STATUS_H

#include "tilewire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TW_ERRMSG_LEN 1024

/* Records a formatted message as this thread's last error and returns status.
 * Internal code fails with `return tw_fail(TW_ERR_..., "what, which, expected")`. */
tw_status_t tw_fail(tw_status_t status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefixes the current thread-local message with context ("while X: <old>"). */
void tw_error_prefix(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Clears the thread-local message. */
void tw_error_clear(void);
/* Copies the thread-local message into dst (TW_ERRMSG_LEN bytes). */
void tw_error_copy(char *dst);

/* Check a call returning tw_status_t; on failure jump to the `fail` label with
 * `st` holding the status. Functions using these declare `tw_status_t st`. */
#define TW_CHECK(call)                                                                             \
  do {                                                                                             \
    st = (call);                                                                                   \
    if (st != TW_SUCCESS)                                                                          \
      goto fail;                                                                                   \
  } while (0)

/* Fail with a message and jump to `fail`. */
#define TW_FAIL(status, ...)                                                                       \
  do {                                                                                             \
    st = tw_fail((status), __VA_ARGS__);                                                           \
    goto fail;                                                                                     \
  } while (0)

/* Argument checks that name the argument: return immediately (no cleanup). */
#define TW_ARG_CHECK(cond, ...)                                                                    \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      return tw_fail(TW_ERR_INVALID_ARGUMENT, __VA_ARGS__);                                        \
  } while (0)

#ifdef __cplusplus
}
#endif
#endif
