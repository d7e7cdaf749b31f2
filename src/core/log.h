/* Host logging to stderr, filtered by TW_LOG_LEVEL. */
#ifndef TW_CORE_LOG_H
#define TW_CORE_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

enum { TW_LOG_WARN = 1, TW_LOG_INFO = 2, TW_LOG_DEBUG = 3 };

/* The level TW_LOG_LEVEL sets (read at every call): 0 silent, 1 warnings (the default), 2 info,
 * 3 debug. */
int tw_log_level(void);

void tw_log(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define TW_WARN(...) tw_log(TW_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define TW_INFO(...) tw_log(TW_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define TW_DEBUG(...) tw_log(TW_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
