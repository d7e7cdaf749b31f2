/*
 * The env knob table (src/core/env_defs.h) and what reads it: every knob is well
 * formed, the environment changes what the library reads, sizes parse, bad values
 * fall back to the default, the log level reads as its knob does, and docs/ENV.md and
 * docs/ENV-DEV.md are what the generator writes today. Runs with the repository root as
 * working directory (for docs/).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/env.h"
#include "core/env_doc.h"
#include "core/log.h"
#include "tw_test.h"

static int is_int_type(const char *type) {
  return !strcmp(type, "int") || !strcmp(type, "size") || !strcmp(type, "bool");
}

/* Strict decimal parse for int/bool defaults: the table must not rely on fallbacks. */
static int parse_decimal(const char *text, int64_t *value) {
  char *end = NULL;
  long long v = strtoll(text, &end, 10);
  if (!*text || *end != '\0')
    return -1;
  *value = v;
  return 0;
}

static void test_table(void) {
  int count = tw_env_count();
  TEST_REQUIRE(count > 0, "tw_env_count() = %d", count);
  TEST_ASSERT(count == TW_ENV_COUNT, "tw_env_count() = %d, the table has %d", count,
              (int)TW_ENV_COUNT);
  for (int i = 0; i < count; i++) {
    const char *name = NULL, *type = NULL, *def = NULL, *current = NULL, *desc = NULL;
    TEST_TW_OK(tw_env_describe(i, &name, &type, &def, &current, &desc));
    TEST_REQUIRE(name && type && def && current && desc, "knob %d has a NULL field", i);
    TEST_ASSERT(!strncmp(name, "TW_", 3) && strlen(name) > 3, "knob %d: name \"%s\"", i, name);
    TEST_ASSERT(!strcmp(type, "int") || !strcmp(type, "size") || !strcmp(type, "bool") ||
                    !strcmp(type, "str"),
                "%s: type \"%s\" is not int, size, bool or str", name, type);
    TEST_ASSERT(strlen(desc) >= 10, "%s: description \"%s\" is too short", name, desc);
    for (int j = 0; j < i; j++) {
      const char *other = NULL;
      TEST_TW_OK(tw_env_describe(j, &other, NULL, NULL, NULL, NULL));
      TEST_ASSERT(strcmp(name, other) != 0, "%s is in the table twice (%d and %d)", name, j, i);
    }
    /* A default that does not parse would be silently replaced by 0. */
    int64_t value = 0;
    if (!strcmp(type, "size"))
      TEST_ASSERT(tw_parse_size(def, &value) == 0, "%s: default \"%s\" is not a size", name, def);
    else if (!strcmp(type, "int"))
      TEST_ASSERT(parse_decimal(def, &value) == 0, "%s: default \"%s\" is not an int", name, def);
    else if (!strcmp(type, "bool"))
      TEST_ASSERT(!strcmp(def, "0") || !strcmp(def, "1"), "%s: default \"%s\" is not 0/1", name,
                  def);
  }
  /* The generator's copy of the table (env_doc.c) is the library's, row for row. */
  int rows_count = 0, alike = 0;
  const tw_env_doc_row *rows = tw_env_doc_rows(&rows_count);
  TEST_REQUIRE(rows_count == count, "env_doc has %d rows, the library %d knobs", rows_count, count);
  for (int i = 0; i < count; i++) {
    const char *name = NULL;
    TEST_TW_OK(tw_env_describe(i, &name, NULL, NULL, NULL, NULL));
    TEST_ASSERT(!strcmp(rows[i].name, name), "row %d: %s in env_doc, %s in the library", i,
                rows[i].name, name);
    TEST_ASSERT(rows[i].developer == (tw_env_class_of((tw_env_id)i) == TW_ENV_DEV),
                "%s: class differs", name);
    TEST_ASSERT(rows[i].alike == tw_env_alike((tw_env_id)i) &&
                    (rows[i].alike == 0 || rows[i].alike == 1),
                "%s: alike %d / %d", name, rows[i].alike, tw_env_alike((tw_env_id)i));
    /* A description that says ranks must agree is a knob the init check compares. */
    if (strstr(rows[i].description, "alike") && strstr(rows[i].description, "every rank"))
      TEST_ASSERT(rows[i].alike, "%s: its description asks for every rank alike, alike is 0", name);
    TEST_ASSERT(!rows[i].alike || strcmp(rows[i].type, "str") != 0,
                "%s: a str knob cannot be alike (the check compares integers)", name);
    alike += rows[i].alike;
  }
  TEST_ASSERT(alike == TW_ENV_ALIKE_COUNT, "%d alike knobs, TW_ENV_ALIKE_COUNT %d", alike,
              (int)TW_ENV_ALIKE_COUNT);
  /* NULL outputs are allowed: a caller may want only the name. */
  TEST_TW_OK(tw_env_describe(0, NULL, NULL, NULL, NULL, NULL));
}

static void test_describe_rejects_bad_index(void) {
  const char *name = NULL;
  TEST_TW_FAILS(tw_env_describe(-1, &name, NULL, NULL, NULL, NULL), TW_ERR_INVALID_ARGUMENT,
                "index");
  TEST_TW_FAILS(tw_env_describe(tw_env_count(), &name, NULL, NULL, NULL, NULL),
                TW_ERR_INVALID_ARGUMENT, "index");
  TEST_TW_FAILS(tw_env_describe(1 << 30, &name, NULL, NULL, NULL, NULL), TW_ERR_INVALID_ARGUMENT,
                "index");
}

/* A valid value of the knob's type, different from its default where possible, and the
 * number tw_env_int must then return. */
static const char *valid_value(const char *type, const char *def, int64_t *expected) {
  if (!strcmp(type, "bool")) {
    *expected = strcmp(def, "1") ? 1 : 0;
    return *expected ? "1" : "0";
  }
  if (!strcmp(type, "size")) {
    *expected = (int64_t)3 << 20;
    return "3M";
  }
  if (!strcmp(type, "int")) {
    *expected = 4242;
    return "4242";
  }
  *expected = 0;
  return "tilewire-test-value";
}

static void test_setenv_changes_current(void) {
  for (int i = 0; i < tw_env_count(); i++) {
    const char *name = NULL, *type = NULL, *def = NULL, *current = NULL;
    TEST_TW_OK(tw_env_describe(i, &name, &type, &def, &current, NULL));
    char *saved = getenv(name) ? strdup(getenv(name)) : NULL;

    unsetenv(name);
    TEST_TW_OK(tw_env_describe(i, NULL, NULL, NULL, &current, NULL));
    TEST_ASSERT(!strcmp(current, def), "%s unset: current \"%s\", default \"%s\"", name, current,
                def);

    int64_t expected = 0;
    const char *value = valid_value(type, def, &expected);
    TEST_REQUIRE(setenv(name, value, 1) == 0, "setenv(%s)", name);
    TEST_TW_OK(tw_env_describe(i, NULL, NULL, NULL, &current, NULL));
    TEST_ASSERT(!strcmp(current, value), "%s=%s: current \"%s\"", name, value, current);
    if (is_int_type(type)) {
      int64_t got = tw_env_int((tw_env_id)i);
      TEST_ASSERT(got == expected, "%s=%s: tw_env_int %lld, expected %lld", name, value,
                  (long long)got, (long long)expected);
    } else {
      TEST_ASSERT(!strcmp(tw_env_str((tw_env_id)i), value), "%s=%s: tw_env_str \"%s\"", name, value,
                  tw_env_str((tw_env_id)i));
    }

    if (saved)
      setenv(name, saved, 1);
    else
      unsetenv(name);
    free(saved);
  }
}

static void test_parse_size(void) {
  static const struct {
    const char *text;
    int64_t value;
  } good[] = {{"64K", 64 << 10}, {"2M", 2 << 20}, {"1G", (int64_t)1 << 30}, {"123", 123},
              {"0", 0},          {"4k", 4 << 10}, {"2T", (int64_t)2 << 40}, {"8MB", 8 << 20}};
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    int64_t value = -7;
    int rc = tw_parse_size(good[i].text, &value);
    TEST_ASSERT(rc == 0 && value == good[i].value, "tw_parse_size(\"%s\") = %d, %lld; want %lld",
                good[i].text, rc, (long long)value, (long long)good[i].value);
  }
  static const char *const bad[] = {"abc", "-1", "1X", "", "K", "1K2", "1.5G", "99999999999999G"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    int64_t value = -7;
    TEST_ASSERT(tw_parse_size(bad[i], &value) != 0, "tw_parse_size(\"%s\") accepted it: %lld",
                bad[i], (long long)value);
  }
  int64_t value = 0;
  TEST_ASSERT(tw_parse_size(NULL, &value) != 0, "tw_parse_size(NULL) accepted it");
}

/* An unparsable value is ignored (with one warning on stderr) and the default is used. */
static void test_invalid_falls_back(void) {
  for (int i = 0; i < tw_env_count(); i++) {
    const char *name = NULL, *type = NULL;
    TEST_TW_OK(tw_env_describe(i, &name, &type, NULL, NULL, NULL));
    if (!is_int_type(type))
      continue;
    char *saved = getenv(name) ? strdup(getenv(name)) : NULL;
    unsetenv(name);
    int64_t def = tw_env_int((tw_env_id)i);
    const char *const invalid[] = {"abc", "1X", "", !strcmp(type, "bool") ? "2" : "12junk"};
    for (size_t v = 0; v < sizeof(invalid) / sizeof(invalid[0]); v++) {
      TEST_REQUIRE(setenv(name, invalid[v], 1) == 0, "setenv(%s)", name);
      int64_t got = tw_env_int((tw_env_id)i);
      TEST_ASSERT(got == def, "%s=\"%s\": tw_env_int %lld, default %lld", name, invalid[v],
                  (long long)got, (long long)def);
    }
    if (saved)
      setenv(name, saved, 1);
    else
      unsetenv(name);
    free(saved);
  }
}

/* Reads a whole file; NULL if it cannot. */
static char *read_file(const char *path, size_t *size) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  char *data = NULL;
  size_t used = 0, capacity = 0;
  for (;;) {
    if (used == capacity) {
      capacity = capacity ? 2 * capacity : 8192;
      char *grown = realloc(data, capacity + 1);
      if (!grown) {
        free(data);
        fclose(f);
        return NULL;
      }
      data = grown;
    }
    size_t n = fread(data + used, 1, capacity - used, f);
    used += n;
    if (n == 0)
      break;
  }
  int failed = ferror(f);
  fclose(f);
  if (failed) {
    free(data);
    return NULL;
  }
  data[used] = '\0';
  *size = used;
  return data;
}

/* log.c reads TW_LOG_LEVEL itself (it sits below env.c, which warns through it): the level
 * it uses is the value tw_env_int gives the knob, valid or not. */
static void test_log_level(void) {
  char *saved = getenv("TW_LOG_LEVEL") ? strdup(getenv("TW_LOG_LEVEL")) : NULL;
  static const char *const values[] = {NULL, "0", "1", "2", "3", "7", "-1", "abc", "2x", ""};
  for (size_t v = 0; v < sizeof(values) / sizeof(values[0]); v++) {
    if (values[v])
      setenv("TW_LOG_LEVEL", values[v], 1);
    else
      unsetenv("TW_LOG_LEVEL");
    const int64_t want = tw_env_int(TW_LOG_LEVEL_ID);
    TEST_ASSERT(tw_log_level() == want, "TW_LOG_LEVEL=%s: log.c %d, the knob %lld",
                values[v] ? values[v] : "(unset)", tw_log_level(), (long long)want);
  }
  if (saved)
    setenv("TW_LOG_LEVEL", saved, 1);
  else
    unsetenv("TW_LOG_LEVEL");
  free(saved);
}

/* docs/ENV.md (developer 0) or docs/ENV-DEV.md (developer 1) is what the generator writes,
 * whatever the environment holds. */
static void test_env_doc_is_current(int developer) {
  const char *const env_doc_path = developer ? "docs/ENV-DEV.md" : "docs/ENV.md";
  const char *const flag = developer ? "--env-dev-markdown" : "--env-markdown";
  char *generated = NULL;
  size_t generated_size = 0;
  FILE *out = open_memstream(&generated, &generated_size);
  TEST_REQUIRE(out, "open_memstream failed");
  TEST_ASSERT(tw_env_markdown(out, developer) == 0, "tw_env_markdown failed");
  TEST_REQUIRE(fclose(out) == 0, "closing the memstream failed");

  /* The generator must not depend on the environment: set every knob and generate again. */
  int count = tw_env_count();
  char **saved = calloc((size_t)count, sizeof(char *));
  TEST_REQUIRE(saved, "out of memory");
  for (int i = 0; i < count; i++) {
    const char *name = NULL;
    TEST_TW_OK(tw_env_describe(i, &name, NULL, NULL, NULL, NULL));
    saved[i] = getenv(name) ? strdup(getenv(name)) : NULL;
    setenv(name, "1", 1);
  }
  char *again = NULL;
  size_t again_size = 0;
  out = open_memstream(&again, &again_size);
  TEST_REQUIRE(out, "open_memstream failed");
  TEST_ASSERT(tw_env_markdown(out, developer) == 0, "tw_env_markdown failed");
  TEST_REQUIRE(fclose(out) == 0, "closing the memstream failed");
  for (int i = count - 1; i >= 0; i--) {
    const char *name = NULL;
    TEST_TW_OK(tw_env_describe(i, &name, NULL, NULL, NULL, NULL));
    if (saved[i])
      setenv(name, saved[i], 1);
    else
      unsetenv(name);
    free(saved[i]);
  }
  free(saved);
  TEST_ASSERT(again_size == generated_size && !memcmp(again, generated, generated_size),
              "the markdown changed with the environment");
  free(again);

  size_t file_size = 0;
  char *file = read_file(env_doc_path, &file_size);
  TEST_ASSERT(file, "cannot read %s (the test runs from the repository root)", env_doc_path);
  if (file) {
    int same = file_size == generated_size && !memcmp(file, generated, file_size);
    if (!same) {
      /* Name the first line that differs so the failure says what is stale. */
      size_t line = 1, i = 0;
      while (i < file_size && i < generated_size && file[i] == generated[i])
        if (file[i++] == '\n')
          line++;
      fprintf(stderr, "%s differs from the generator at line %zu\n", env_doc_path, line);
    }
    TEST_ASSERT(same, "%s is out of date: run `tw-info %s > %s`", env_doc_path, flag, env_doc_path);
  }
  free(file);
  free(generated);
}

int main(void) {
  test_table();
  test_describe_rejects_bad_index();
  test_setenv_changes_current();
  test_parse_size();
  test_invalid_falls_back();
  test_log_level();
  test_env_doc_is_current(0);
  test_env_doc_is_current(1);
  return tw_test_finish();
}
