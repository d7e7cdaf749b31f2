/*
 * The TMA tensor map memo (src/gemm/tma_map.c), without a GPU (run in CI): a map put for one set
 * of arguments comes back only for exactly those arguments, in this thread only, and a slot
 * reused by other arguments forgets the earlier ones. tw_tma_map_2d itself needs the driver;
 * the GPU tests cover it.
 */
#include <pthread.h>
#include <string.h>

#include "gemm/tma_map.h"
#include "tw_test.h"

static CUtensorMap fake_map(unsigned char fill) {
  CUtensorMap m;
  memset(&m, fill, sizeof(m));
  return m;
}

static tw_tma_args_t args_at(const void *ptr) {
  tw_tma_args_t a = {ptr, 4096, 2048, 4096, 64, 128, (int32_t)CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2};
  return a;
}

static void test_hit_only_for_the_same_arguments(void) {
  tw_tma_memo_clear();
  const tw_tma_args_t a = args_at((const void *)0x7f0000001000ull);
  CUtensorMap got, want = fake_map(0xab);
  TEST_ASSERT(!tw_tma_memo_get(&a, &got), "an empty memo hits");
  tw_tma_memo_put(&a, &want);
  TEST_ASSERT(tw_tma_memo_get(&a, &got) && !memcmp(&got, &want, sizeof(got)),
              "the map put is not the map got back");
  /* every field is part of the key */
  for (int field = 0; field < 8; field++) {
    tw_tma_args_t b = a;
    switch (field) {
    case 0: b.ptr = (const char *)a.ptr + 128; break;
    case 1: b.cols += 8; break;
    case 2: b.rows += 1; break;
    case 3: b.ld += 8; break;
    case 4: b.box_cols = 32; break;
    case 5: b.box_rows = 64; break;
    case 6: b.dtype = (int32_t)CU_TENSOR_MAP_DATA_TYPE_FLOAT32; break;
    default: b.elem_bytes = 4; break;
    }
    TEST_ASSERT(!tw_tma_memo_get(&b, &got), "field %d changed, yet the memo hit", field);
  }
  tw_tma_memo_clear();
  TEST_ASSERT(!tw_tma_memo_get(&a, &got), "a cleared memo hits");
}

/* Many argument sets: each get returns the map put for its own arguments or misses, never
 * another's (slots collide and are overwritten). */
static void test_collisions_never_return_another_map(void) {
  tw_tma_memo_clear();
  enum { N = 4 * TW_TMA_MEMO_SLOTS };
  for (int i = 0; i < N; i++) {
    tw_tma_args_t a = args_at((const void *)(0x7f0000000000ull + (uint64_t)i * 4096));
    CUtensorMap m = fake_map((unsigned char)(i & 0xff));
    tw_tma_memo_put(&a, &m);
  }
  int hits = 0;
  for (int i = 0; i < N; i++) {
    tw_tma_args_t a = args_at((const void *)(0x7f0000000000ull + (uint64_t)i * 4096));
    CUtensorMap got, want = fake_map((unsigned char)(i & 0xff));
    if (tw_tma_memo_get(&a, &got)) {
      hits++;
      TEST_ASSERT(!memcmp(&got, &want, sizeof(got)), "entry %d: another entry's map", i);
    }
  }
  TEST_ASSERT(hits > 0 && hits <= TW_TMA_MEMO_SLOTS, "%d hits from %d slots", hits,
              TW_TMA_MEMO_SLOTS);
  /* the last map put is always there (nothing overwrote its slot since) */
  tw_tma_args_t last = args_at((const void *)(0x7f0000000000ull + (uint64_t)(N - 1) * 4096));
  CUtensorMap got;
  TEST_ASSERT(tw_tma_memo_get(&last, &got), "the last map put is gone");
}

static void *other_thread(void *arg) {
  const tw_tma_args_t *a = (const tw_tma_args_t *)arg;
  CUtensorMap got;
  return (void *)(intptr_t)tw_tma_memo_get(a, &got);
}

static void test_per_thread(void) {
  tw_tma_memo_clear();
  tw_tma_args_t a = args_at((const void *)0x7f0000002000ull);
  CUtensorMap m = fake_map(0x5a);
  tw_tma_memo_put(&a, &m);
  pthread_t t;
  void *hit = NULL;
  TEST_ASSERT(pthread_create(&t, NULL, other_thread, &a) == 0, "pthread_create");
  pthread_join(t, &hit);
  TEST_ASSERT(hit == NULL, "another thread saw this thread's map");
  tw_tma_memo_clear();
}

int main(void) {
  test_hit_only_for_the_same_arguments();
  test_collisions_never_return_another_map();
  test_per_thread();
  return tw_test_finish();
}
