#include "core/env.h"

#include <ctype.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/status.h"

typedef struct env_entry {
  const char *name;
  const char *type;
  const char *default_value;
  const char *description;
  tw_env_class cls;
  int alike;
} env_entry;

static const env_entry env_table[TW_ENV_COUNT] = {
#define TW_ENV(name, type, def, cls, alike, desc) {#name, #type, def, desc, TW_ENV_##cls, alike},
#include "core/env_defs.h"
#undef TW_ENV
};

int tw_parse_size(const char *text, int64_t *value) {
  if (!text || !*text)
    return -1;
  errno = 0;
  char *end = NULL;
  long long v = strtoll(text, &end, 10);
  if (errno || end == text || v < 0)
    return -1;
  int shift = 0;
  switch (toupper((unsigned char)*end)) {
  case '\0': break;
  case 'K':
    shift = 10;
    end++;
    break;
  case 'M':
    shift = 20;
    end++;
    break;
  case 'G':
    shift = 30;
    end++;
    break;
  case 'T':
    shift = 40;
    end++;
    break;
  default: return -1;
  }
  if (*end == 'B' || *end == 'b')
    end++;
  if (*end != '\0')
    return -1;
  if (shift && v > (INT64_MAX >> shift))
    return -1;
  *value = (int64_t)v << shift;
  return 0;
}

static int parse_knob(tw_env_id id, const char *text, int64_t *value) {
  const char *type = env_table[id].type;
  if (strcmp(type, "size") == 0)
    return tw_parse_size(text, value);
  errno = 0;
  char *end = NULL;
  long long v = strtoll(text, &end, 10);
  if (errno || end == text || *end != '\0')
    return -1;
  if (strcmp(type, "bool") == 0 && v != 0 && v != 1)
    return -1;
  *value = v;
  return 0;
}

int64_t tw_env_int(tw_env_id id) {
  static atomic_int warned[TW_ENV_COUNT];
  int64_t value = 0;
  const char *text = getenv(env_table[id].name);
  if (text && *text) {
    if (parse_knob(id, text, &value) == 0)
      return value;
    if (atomic_exchange(&warned[id], 1) == 0) {
      TW_WARN("ignoring %s=\"%s\": not a valid %s; using the default %s", env_table[id].name, text,
              env_table[id].type, env_table[id].default_value);
    }
  }
  parse_knob(id, env_table[id].default_value, &value);
  return value;
}

const char *tw_env_str(tw_env_id id) {
  const char *text = getenv(env_table[id].name);
  return (text && *text) ? text : env_table[id].default_value;
}

int tw_env_alike(tw_env_id id) { return env_table[id].alike; }

tw_env_class tw_env_class_of(tw_env_id id) { return env_table[id].cls; }

int tw_env_count(void) { return TW_ENV_COUNT; }

tw_status_t tw_env_describe(int index, const char **name, const char **type,
                            const char **default_value, const char **current_value,
                            const char **description) {
  TW_ARG_CHECK(index >= 0 && index < TW_ENV_COUNT, "index: %d is outside [0, %d)", index,
               TW_ENV_COUNT);
  const env_entry *e = &env_table[index];
  if (name)
    *name = e->name;
  if (type)
    *type = e->type;
  if (default_value)
    *default_value = e->default_value;
  if (description)
    *description = e->description;
  if (current_value)
    *current_value = tw_env_str((tw_env_id)index);
  return TW_SUCCESS;
}
