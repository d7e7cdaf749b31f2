/*
 * Injected failures (TW_VD_FAIL at ibv_open_device, tw_vd_inject at any time) and the
 * process-wide statistics (tw_vd_stats).
 *
 * Spec: rules separated by ';', each "kind:selector[:after=N]" in any order after the kind:
 *   kind      wc_error | qp_error | silent
 *   selector  port=<LID> | port=* | dev=<index in the device list> | dev=<device name>
 *   after     N (default 0): the rule fires on the instance's (N+1)-th send WR (wc_error,
 *             qp_error) or data packet received (silent), counted from when the rule was added
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vd.h"

struct vd_stats_atomic vd_stats;

enum { SEL_ALL = 1, SEL_LID, SEL_DEVIDX, SEL_DEVNAME };

struct vd_spec {
  int kind;
  int sel;
  uint32_t lid;
  int devidx;
  char name[64];
  uint64_t after;
};

#define VD_MAX_SPECS 64
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vd_ctx *g_open;
static struct vd_spec g_specs[VD_MAX_SPECS]; /* for instances opened later */
static int g_nspecs;

static int parse_one(const char *text, size_t len, struct vd_spec *out) {
  char buf[256];
  if (len == 0 || len >= sizeof(buf))
    return -1;
  memcpy(buf, text, len);
  buf[len] = '\0';
  memset(out, 0, sizeof(*out));
  char *save = NULL;
  char *tok = strtok_r(buf, ":", &save);
  if (!tok)
    return -1;
  if (strcmp(tok, "wc_error") == 0)
    out->kind = VD_RULE_WC_ERROR;
  else if (strcmp(tok, "qp_error") == 0)
    out->kind = VD_RULE_QP_ERROR;
  else if (strcmp(tok, "silent") == 0)
    out->kind = VD_RULE_SILENT;
  else
    return -1;
  while ((tok = strtok_r(NULL, ":", &save)) != NULL) {
    char *end;
    if (strncmp(tok, "port=", 5) == 0) {
      if (strcmp(tok + 5, "*") == 0) {
        out->sel = SEL_ALL;
        continue;
      }
      unsigned long lid = strtoul(tok + 5, &end, 0);
      if (end == tok + 5 || *end || lid == 0 || lid > 0xFFFF)
        return -1;
      out->sel = SEL_LID;
      out->lid = (uint32_t)lid;
    } else if (strncmp(tok, "dev=", 4) == 0) {
      long idx = strtol(tok + 4, &end, 10);
      if (end != tok + 4 && !*end && idx >= 0) {
        out->sel = SEL_DEVIDX;
        out->devidx = (int)idx;
      } else if (tok[4] && strlen(tok + 4) < sizeof(out->name)) {
        out->sel = SEL_DEVNAME;
        snprintf(out->name, sizeof(out->name), "%s", tok + 4);
      } else {
        return -1;
      }
    } else if (strncmp(tok, "after=", 6) == 0) {
      unsigned long long n = strtoull(tok + 6, &end, 10);
      if (end == tok + 6 || *end)
        return -1;
      out->after = n;
    } else {
      return -1;
    }
  }
  return out->sel ? 0 : -1;
}

/* Parses every rule of spec into specs[]; returns the count or -1. "" gives 0. */
static int parse_spec(const char *spec, struct vd_spec *specs, int max) {
  int n = 0;
  const char *s = spec;
  while (s && *s) {
    const char *semi = strchr(s, ';');
    size_t len = semi ? (size_t)(semi - s) : strlen(s);
    if (len) {
      if (n == max || parse_one(s, len, &specs[n]) != 0)
        return -1;
      n++;
    }
    s = semi ? semi + 1 : s + len;
  }
  return n;
}

static int spec_matches(const struct vd_spec *s, const struct vd_ctx *c) {
  switch (s->sel) {
  case SEL_ALL: return 1;
  case SEL_LID: return s->lid == c->lid;
  case SEL_DEVIDX: return s->devidx == c->dev->index;
  case SEL_DEVNAME: return strcmp(s->name, c->dev->dev.name) == 0;
  default: return 0;
  }
}

static void add_rule(struct vd_ctx *c, const struct vd_spec *s) {
  vd_lock(&c->rule_lock);
  if (c->nrules < VD_MAX_RULES) {
    struct vd_rule *r = &c->rules[c->nrules++];
    r->kind = s->kind;
    r->after = s->after;
    r->count = 0;
    r->fired = 0;
  } else {
    fprintf(stderr, "tw-verbs-double: more than %d injected rules on LID %u; rule ignored\n",
            VD_MAX_RULES, c->lid);
  }
  vd_unlock(&c->rule_lock);
}

int vd_rules_for_new_port(struct vd_ctx *c) {
  struct vd_spec env_specs[VD_MAX_RULES];
  const char *env = getenv("TW_VD_FAIL");
  int n = parse_spec(env, env_specs, VD_MAX_RULES);
  if (n < 0) {
    fprintf(stderr,
            "tw-verbs-double: TW_VD_FAIL=\"%s\": expected kind:port=<lid|*>[:after=N] "
            "rules separated by ';' (kind: wc_error, qp_error, silent)\n",
            env);
    return EINVAL;
  }
  for (int i = 0; i < n; i++)
    if (spec_matches(&env_specs[i], c))
      add_rule(c, &env_specs[i]);
  vd_lock(&g_reg_lock);
  for (int i = 0; i < g_nspecs; i++)
    if (spec_matches(&g_specs[i], c))
      add_rule(c, &g_specs[i]);
  vd_unlock(&g_reg_lock);
  return 0;
}

int tw_vd_inject(const char *spec) {
  if (!spec)
    return -1;
  vd_lock(&g_reg_lock);
  if (strcmp(spec, "clear") == 0) {
    g_nspecs = 0;
    for (struct vd_ctx *c = g_open; c; c = c->next_open) {
      vd_lock(&c->rule_lock);
      c->nrules = 0;
      vd_unlock(&c->rule_lock);
      atomic_store(&c->silent, 0);
    }
    vd_unlock(&g_reg_lock);
    return 0;
  }
  struct vd_spec specs[VD_MAX_SPECS];
  int n = parse_spec(spec, specs, VD_MAX_SPECS);
  if (n < 0 || g_nspecs + n > VD_MAX_SPECS) {
    vd_unlock(&g_reg_lock);
    fprintf(stderr, "tw-verbs-double: tw_vd_inject(\"%s\"): bad spec\n", spec);
    return -1;
  }
  for (int i = 0; i < n; i++) {
    g_specs[g_nspecs++] = specs[i];
    for (struct vd_ctx *c = g_open; c; c = c->next_open)
      if (spec_matches(&specs[i], c))
        add_rule(c, &specs[i]);
  }
  vd_unlock(&g_reg_lock);
  return 0;
}

void vd_register_ctx(struct vd_ctx *c) {
  vd_lock(&g_reg_lock);
  c->next_open = g_open;
  g_open = c;
  vd_unlock(&g_reg_lock);
}

void vd_unregister_ctx(struct vd_ctx *c) {
  vd_lock(&g_reg_lock);
  for (struct vd_ctx **p = &g_open; *p; p = &(*p)->next_open)
    if (*p == c) {
      *p = c->next_open;
      break;
    }
  vd_unlock(&g_reg_lock);
}

/* A forked child's list holds the parent's contexts, whose engines did not come along */
void vd_inject_after_fork(void) {
  pthread_mutex_init(&g_reg_lock, NULL);
  g_open = NULL;
}

int vd_rule_on_send_wr(struct vd_ctx *c) {
  int fired = 0;
  if (!atomic_load_explicit(&c->nrules, memory_order_relaxed))
    return 0;
  vd_lock(&c->rule_lock);
  for (int i = 0; i < c->nrules; i++) {
    struct vd_rule *r = &c->rules[i];
    if (r->kind == VD_RULE_SILENT || r->fired)
      continue;
    if (r->count++ == r->after && !fired) {
      r->fired = 1;
      fired = r->kind;
    }
  }
  vd_unlock(&c->rule_lock);
  return fired;
}

int vd_rule_on_rx(struct vd_ctx *c) {
  if (atomic_load_explicit(&c->silent, memory_order_relaxed))
    return 1;
  if (!atomic_load_explicit(&c->nrules, memory_order_relaxed))
    return 0;
  int silent = 0;
  vd_lock(&c->rule_lock);
  for (int i = 0; i < c->nrules; i++) {
    struct vd_rule *r = &c->rules[i];
    if (r->kind != VD_RULE_SILENT)
      continue;
    if (r->fired || r->count == r->after) {
      r->fired = 1;
      silent = 1;
    } else {
      r->count++;
    }
  }
  vd_unlock(&c->rule_lock);
  if (silent)
    atomic_store(&c->silent, 1);
  return silent;
}

int tw_vd_stats(struct tw_vd_stats *out) {
  if (!out)
    return -1;
  out->packets_sent = atomic_load(&vd_stats.packets_sent);
  out->bytes_sent = atomic_load(&vd_stats.bytes_sent);
  out->packets_applied = atomic_load(&vd_stats.packets_applied);
  out->bytes_applied = atomic_load(&vd_stats.bytes_applied);
  out->acks = atomic_load(&vd_stats.acks);
  out->reordered = atomic_load(&vd_stats.reordered);
  out->rnr_waits = atomic_load(&vd_stats.rnr_waits);
  out->wr_errors = atomic_load(&vd_stats.wr_errors);
  out->cq_overflows = atomic_load(&vd_stats.cq_overflows);
  out->flushed = atomic_load(&vd_stats.flushed);
  out->dropped = atomic_load(&vd_stats.dropped);
  return 0;
}
