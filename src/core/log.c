#include "core/log.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* TW_LOG_LEVEL is read here with getenv, not through tw_env_int: env.c warns about a bad knob
 * value through this file, so log.c stays below env.c (no import loop). The parse is env.c's
 * for an int knob (a whole decimal number, else the table's default of 1); the knob keeps its
 * row in env_defs.h for the docs, and tests/host/test_env.c checks both read it alike. */
int tw_log_level(void) {
  const char *text = getenv("TW_LOG_LEVEL");
  if (!text || !*text)
    return TW_LOG_WARN;
  errno = 0;
  char *end = NULL;
  const long long v = strtoll(text, &end, 10);
  if (errno || end == text || *end != '\0')
    return TW_LOG_WARN;
  return v > INT_MAX ? INT_MAX : v < INT_MIN ? INT_MIN : (int)v;
}

void tw_log(int level, const char *file, int line, const char *fmt, ...) {
  if (level > tw_log_level())
    return;
  static const char *names[] = {"", "WARN", "INFO", "DEBUG"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "tilewire %s [pid %d] %s:%d: %s\n", names[level], (int)getpid(), file, line, msg);
}
