#include "core/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "core/env.h"

void tw_log(int level, const char *file, int line, const char *fmt, ...) {
  if (level > tw_env_int(TW_LOG_LEVEL_ID))
    return;
  static const char *names[] = {"", "WARN", "INFO", "DEBUG"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "tilewire %s [pid %d] %s:%d: %s\n", names[level], (int)getpid(), file, line, msg);
}
