"""python -m tilewire.bench: runs tw-bench's sweeps, shows progress over shapes, prints the
side-by-side table and writes the JSON and one PNG per op (speedup over the op's baseline,
and TFLOP/s, or GB/s, per shape).

    python -m tilewire.bench                 # every op tw-bench lists, full sweeps
    python -m tilewire.bench gemm --quick    # one op, its small sweep
    python -m tilewire.bench --plot results.json --out plots   # re-plot a saved run

tw-bench is looked for at --bench, then $TILEWIRE_BENCH, the package's own copy (which
`pip install .` puts beside the package's libtilewire), beside the libtilewire in use
($TILEWIRE_LIB or the source tree's build/), then on PATH (find_bench; --help says which one
it found). Each op runs as its own `tw-bench OP --json FILE`; its stderr (progress lines
`[op i/n] ...`) drives the progress bar (tqdm when installed), its own table goes to
OUT/tw-bench-OP.txt. Exit status: 0 all rows passed, 1 a check or an op
failed, 2 no Hopper GPU, 64 bad command line.
"""

import argparse
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

EXIT_FAILED, EXIT_NO_HOPPER, EXIT_USAGE = 1, 2, 64

_PROGRESS = re.compile(r"^\[(?P<op>\S+) (?P<i>\d+)/(?P<n>\d+)\] (?P<rest>.*)$")
_DONE = re.compile(r"^\d+ rows, \d+ failed")

# ---- finding and asking tw-bench ----------------------------------------------------------


BENCH_NAME = "tw-bench"

HOW_TO_GET_BENCH = (
    "get one with `pip install .` from a tilewire source tree on a machine with the CUDA "
    "toolkit (the package then carries tw-bench), or build it with `make` at the source "
    "tree's root and point at it: TILEWIRE_BENCH=build/tw-bench (or --bench build/tw-bench)"
)


def bench_candidates(explicit=None):
    """[(path, where it comes from)]: where find_bench looks for tw-bench, in order."""
    from . import _lib

    candidates = []

    def add(path, where):
        path = pathlib.Path(path)
        if all(path != c for c, _ in candidates):
            candidates.append((path, where))

    if explicit:
        add(explicit, "--bench")
    if os.environ.get("TILEWIRE_BENCH"):
        add(os.environ["TILEWIRE_BENCH"], "TILEWIRE_BENCH")
    add(_lib._PACKAGE_DIR / BENCH_NAME, "the package's own copy")
    lib = _lib.library_location()
    if lib is not None:
        add(pathlib.Path(lib).resolve().parent / BENCH_NAME, "beside the library in use, %s" % lib)
    add(_lib._SOURCE_BUILD_DIR / BENCH_NAME, "the source tree's build/")
    on_path = shutil.which(BENCH_NAME)
    if on_path:
        add(on_path, "PATH")
    return candidates


def _runnable(path):
    return path.is_file() and os.access(path, os.X_OK)


def find_bench(explicit=None):
    """The tw-bench executable, or None. An executable given by --bench or TILEWIRE_BENCH
    is the one used: when it is not there, None (the caller says so)."""
    for path, where in bench_candidates(explicit):
        if _runnable(path):
            return path
        if where in ("--bench", "TILEWIRE_BENCH"):
            return None
    return None


def bench_not_found(explicit=None):
    """Why find_bench found none, and how to get one."""
    for path, where in bench_candidates(explicit):
        if where in ("--bench", "TILEWIRE_BENCH") and not _runnable(path):
            return "tilewire.bench: %s=%s is not an executable file" % (where, path)
    looked = ["%s (%s)" % (path, where) for path, where in bench_candidates(explicit)]
    return "tilewire.bench: tw-bench not found (looked at %s; none on PATH): %s" % (
        ", ".join(looked), HOW_TO_GET_BENCH)


def _bench_line():
    """The line --help ends with: which tw-bench a run would use."""
    found = find_bench()
    if found is None:
        return "tw-bench: none found; " + HOW_TO_GET_BENCH
    where = next(w for p, w in bench_candidates() if p == found)
    return "tw-bench: %s (%s)" % (found, where)


def list_ops(bench):
    """[(name, help, sweep_count, quick_count)] from `tw-bench --list`."""
    out = subprocess.run([str(bench), "--list"], capture_output=True, text=True, check=True)
    ops = []
    for line in out.stdout.splitlines():
        counts = re.match(r"^\s+sweep: (\d+) shapes, quick: (\d+) shapes", line)
        if counts and ops:
            name, help_text, _, _ = ops[-1]
            ops[-1] = (name, help_text, int(counts.group(1)), int(counts.group(2)))
            continue
        m = re.match(r"^(\S+)\s*(.*)$", line)
        if m and line.strip() != "no ops in this build":
            ops.append((m.group(1), m.group(2).strip(), 0, 0))
    return ops


def _shape_count(op_entry, quick, one_shape):
    _, _, sweep, quick_count = op_entry
    if one_shape:
        return 1
    if quick:
        return quick_count if quick_count > 0 else min(sweep, 1)
    return sweep


# ---- progress -----------------------------------------------------------------------------


class _TextProgress:
    """A minimal stand-in for tqdm on stderr."""

    def __init__(self, total):
        self.total = total
        self.n = 0
        self.desc = ""
        self.tty = sys.stderr.isatty()

    def set_description(self, desc):
        self.desc = desc
        self._draw()

    def update(self, k=1):
        self.n += k
        self._draw(final=not self.tty)

    def write(self, line):
        if self.tty:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(line + "\n")
        self._draw()

    def _draw(self, final=False):
        if not (self.tty or final):
            return
        total = max(self.total, self.n, 1)
        width = 30
        filled = int(width * self.n / total)
        bar = "#" * filled + "." * (width - filled)
        percent = 100 * self.n // total
        text = "[%s] %d/%d shapes %3d%% %s" % (bar, self.n, total, percent, self.desc)
        if self.tty:
            sys.stderr.write("\r\033[K" + text[:160])
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _progress(total, enabled=True):
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, unit="shape", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            pass
    return _TextProgress(total)


# ---- running ------------------------------------------------------------------------------


def run_op(bench, op, passthrough, out_dir, bar, log):
    """Runs one op; returns (exit status, the JSON document or None)."""
    fd, json_path = tempfile.mkstemp(prefix="tw-bench-%s-" % op, suffix=".json")
    os.close(fd)
    cmd = [str(bench), op, "--json", json_path] + passthrough
    log.write("$ %s\n" % " ".join(cmd))
    table_path = out_dir / ("tw-bench-%s.txt" % _safe(op))
    try:
        with open(table_path, "w") as table:
            with subprocess.Popen(cmd, stdout=table, stderr=subprocess.PIPE, text=True,
                                  bufsize=1) as proc:
                for line in proc.stderr:
                    line = line.rstrip("\n")
                    log.write(line + "\n")
                    m = _PROGRESS.match(line)
                    if m:
                        rest = m.group("rest")
                        if _DONE.match(rest):
                            bar.update(1)
                        elif rest.endswith(" ..."):
                            bar.set_description("%s %s/%s" % (op, m.group("i"), m.group("n")))
                        continue
                    bar.write(line)
            rc = proc.returncode
        doc = None
        if os.path.getsize(json_path) > 0:
            with open(json_path) as f:
                doc = json.load(f)
        return rc, doc
    finally:
        os.unlink(json_path)


def _safe(name):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def merge(docs, command):
    """One {"meta", "rows"} document from the per-op runs [(op, rc, doc)]."""
    meta = {}
    rows = []
    runs = []
    for op, rc, doc in docs:
        runs.append({"op": op, "exit_status": rc,
                     "command": (doc or {}).get("meta", {}).get("command")})
        if not doc:
            continue
        if not meta:
            meta = dict(doc.get("meta", {}))
        rows.extend(doc.get("rows", []))
    meta["tool"] = "tilewire.bench"
    meta["command"] = command
    meta["runs"] = runs
    return {"meta": meta, "rows": rows}


# ---- the table ----------------------------------------------------------------------------

_COLUMNS = ("op", "shape", "variant", "ms", "p10-p90", "TFLOP/s", "GB/s", "speedup", "overlap",
            "check")
_LEFT = {"op", "shape", "variant", "check"}


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _ms(x):
    if not _positive(x):
        return "-"
    if x < 0.1:
        return "%.4f" % x
    if x < 10:
        return "%.3f" % x
    if x < 1000:
        return "%.2f" % x
    return "%.1f" % x


def _figure(x, decimals, suffix=""):
    return "%.*f%s" % (decimals, x, suffix) if _positive(x) else "-"


def _cells(row):
    ms, p10, p90 = row.get("ms"), row.get("ms_p10"), row.get("ms_p90")
    spread = "-"
    if _positive(ms) and isinstance(p10, (int, float)) and isinstance(p90, (int, float)) \
            and p90 >= p10:
        spread = "%.1f%%" % (100.0 * (p90 - p10) / ms)
    return [
        str(row.get("op", "")),
        str(row.get("shape", "")),
        str(row.get("variant", "")),
        _ms(ms),
        spread,
        _figure(row.get("tflops"), 1),
        _figure(row.get("gbps"), 1),
        _figure(row.get("speedup"), 2, "x"),
        _figure(row.get("overlap"), 2),
        "ok" if row.get("ok", True) else "FAIL",
    ]


def header_line(meta):
    parts = ["tilewire.bench %s" % meta.get("date", "")]
    if meta.get("gpu"):
        parts.append("%s x%s" % (meta["gpu"], meta.get("gpu_count", "?")))
    if meta.get("sm_count"):
        parts.append("%s SMs, sm_%s" % (meta["sm_count"],
                                        str(meta.get("compute_capability", "")).replace(".", "")))
    if meta.get("driver"):
        parts.append("driver %s, runtime %s" % (meta["driver"], meta.get("runtime", "?")))
    if meta.get("tilewire"):
        parts.append("tilewire %s" % meta["tilewire"])
    if meta.get("host"):
        parts.append("host %s" % meta["host"])
    return " | ".join(parts)


def format_table(doc):
    """The side-by-side table of every row, as tw-bench prints it."""
    rows = doc.get("rows", [])
    cells = [_cells(r) for r in rows]
    width = [len(c) for c in _COLUMNS]
    for row in cells:
        width = [max(w, len(c)) for w, c in zip(width, row)]

    def line(row):
        out = []
        for i, (c, title) in enumerate(zip(row, _COLUMNS)):
            if i == len(row) - 1:
                out.append(c)
            elif title in _LEFT:
                out.append(c.ljust(width[i]))
            else:
                out.append(c.rjust(width[i]))
        return "  ".join(out)

    meta = doc.get("meta", {})
    text = [header_line(meta)]
    if meta.get("command"):
        text.append("command: %s" % meta["command"])
    text += ["", line(_COLUMNS), "-" * (sum(width) + 2 * (len(width) - 1))]
    for i, (row, c) in enumerate(zip(rows, cells)):
        if i and (row.get("op"), row.get("shape")) != (rows[i - 1].get("op"),
                                                       rows[i - 1].get("shape")):
            text.append("")
        text.append(line(c))
    if not rows:
        text.append("(no rows)")
    failed = sum(1 for r in rows if not r.get("ok", True))
    text += ["", "ms: median; p10-p90: (p90 - p10) / median; TFLOP/s: per GPU; speedup: the "
                 "op's baseline time / this time;", "overlap: max(t_compute, t_comm) / t_fused.",
             "%d rows, %d failed" % (len(rows), failed)]
    return "\n".join(text) + "\n"


# ---- the multi-GPU yardstick -------------------------------------------------------------


def bound_rows(doc):
    """Per fused row of a shape that has NCCL's bound rows (ranks on distinct GPUs): the
    multi-GPU yardstick, its speedup over NCCL + cuBLAS divided by the bound
    (t_gemm + t_nccl) / max(t_gemm, t_nccl) of the same run ("bound" for fp32 rows,
    "bound-bf16" for the bf16-partials rows, whose speedup is against the bf16 pipeline), and
    its overlap max(t_gemm, t_nccl) / t_fused. The two agree only where the NCCL + cuBLAS
    pipeline takes exactly the sum of its pieces timed alone. Returns dicts with op, shape,
    variant, ms, speedup, bound, of_bound, overlap."""
    rows = doc.get("rows", [])
    out = []
    for op, shape in _ordered((r.get("op"), r.get("shape")) for r in rows):
        mine = [r for r in rows if (r.get("op"), r.get("shape")) == (op, shape)]
        bounds = {r.get("variant"): r.get("speedup") for r in mine
                  if r.get("variant") in ("bound", "bound-bf16") and _positive(r.get("speedup"))}
        if not bounds:
            continue
        # the pipelines' times, so a file whose speedups were rebased (the README's merged
        # one: every speedup over fp32 NCCL) still gives each row its own pipeline's ratio
        # (tw-bench's cuBLAS pipelines; tilewire.bench_dist's torch ones)
        base_ms = {r.get("variant").replace("+torch", "+cublas"): r.get("ms") for r in mine
                   if r.get("variant") in ("nccl+cublas", "nccl-bf16+cublas", "nccl+torch",
                                           "nccl-bf16+torch") and _positive(r.get("ms"))}
        for r in mine:
            variant = str(r.get("variant", ""))
            if variant.startswith("bound") or not _positive(r.get("overlap")):
                continue
            if "[" in variant:  # TW_BENCH_AB rows: shorter blocks, compared among themselves
                continue
            bf16 = "bf16" in variant
            bound = bounds.get("bound-bf16" if bf16 else "bound")
            base = base_ms.get("nccl-bf16+cublas" if bf16 else "nccl+cublas")
            speedup = base / r["ms"] if base and _positive(r.get("ms")) else r.get("speedup")
            if not _positive(bound) or not _positive(speedup):
                continue
            out.append({"op": op, "shape": shape, "variant": variant, "ms": r.get("ms"),
                        "speedup": speedup, "bound": bound, "of_bound": speedup / bound,
                        "overlap": r["overlap"]})
    return out


def format_bound_table(doc):
    """bound_rows as text, or "" where no shape has NCCL's bound rows."""
    rows = bound_rows(doc)
    if not rows:
        return ""
    titles = ("op", "shape", "variant", "ms", "speedup", "bound", "of-bound", "overlap")
    cells = [[r["op"], r["shape"], r["variant"], _ms(r["ms"]), _figure(r["speedup"], 2, "x"),
              _figure(r["bound"], 2, "x"), _figure(r["of_bound"], 2), _figure(r["overlap"], 2)]
             for r in rows]
    width = [max([len(t)] + [len(c[i]) for c in cells]) for i, t in enumerate(titles)]

    def line(row):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, width))).rstrip()

    text = ["Against NCCL + cuBLAS (the multi-GPU yardstick): of-bound = speedup / bound, "
            "bound = (t_gemm + t_nccl) / max(t_gemm, t_nccl);",
            "overlap = max(t_gemm, t_nccl) / t_fused. bf16p rows: against the bf16 pipeline.",
            "", line(titles), "-" * (sum(width) + 2 * (len(width) - 1))]
    text += [line(c) for c in cells]
    return "\n".join(text) + "\n"


# ---- plots --------------------------------------------------------------------------------


def _ordered(values):
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def baseline_variant(rows):
    """The variant every speedup of an op is measured against: the one whose speedup is 1
    on every shape it has (None when the op reports no speedups)."""
    for variant in _ordered(r.get("variant") for r in rows):
        speedups = [r.get("speedup") for r in rows if r.get("variant") == variant]
        if speedups and all(_positive(s) and abs(s - 1.0) < 1e-6 for s in speedups):
            return variant
    return None


def _value(row, key):
    v = row.get(key)
    return v if _positive(v) else float("nan")


def plot_op(op, rows, meta, path):
    """One figure: speedup over the baseline (top) and TFLOP/s or GB/s (bottom) per shape."""
    from matplotlib.figure import Figure

    shapes = _ordered(r.get("shape") for r in rows)
    variants = _ordered(r.get("variant") for r in rows)
    by_key = {(r.get("shape"), r.get("variant")): r for r in rows}
    baseline = baseline_variant(rows)
    if any(_positive(r.get("tflops")) for r in rows):
        metric, label = "tflops", "TFLOP/s (per GPU)"
    elif any(_positive(r.get("gbps")) for r in rows):
        metric, label = "gbps", "GB/s"
    else:
        metric, label = "ms", "time (ms, median)"

    fig = Figure(figsize=(max(7.0, 1.0 + 1.1 * len(shapes)), 7.5), constrained_layout=True)
    ax_speed, ax_rate = fig.subplots(2, 1, sharex=True)
    xs = list(range(len(shapes)))

    def bars(ax, names, key, fmt):
        width = 0.8 / max(len(names), 1)
        for i, variant in enumerate(names):
            offs = [x - 0.4 + width * (i + 0.5) for x in xs]
            rows_v = [by_key.get((s, variant), {}) for s in shapes]
            heights = [_value(r, key) for r in rows_v]
            # A variant keeps its colour in both panels.
            drawn = ax.bar(offs, heights, width, label=variant,
                           color="C%d" % (variants.index(variant) % 10))
            labels = [fmt % h if math.isfinite(h) else "" for h in heights]
            ax.bar_label(drawn, labels=labels, fontsize="x-small", padding=1)
            for rect, r in zip(drawn, rows_v):
                if r and not r.get("ok", True):
                    rect.set_hatch("//")
                    rect.set_edgecolor("red")

    compared = [v for v in variants if v != baseline]
    if baseline is not None and compared:
        bars(ax_speed, compared, "speedup", "%.2fx")
        ax_speed.axhline(1.0, color="0.3", linestyle="--", linewidth=1,
                         label="%s (baseline)" % baseline)
        ax_speed.set_ylabel("speedup over %s" % baseline)
        ax_speed.legend(fontsize="small")
    else:
        ax_speed.text(0.5, 0.5, "no baseline speedups reported for this op",
                      ha="center", va="center", transform=ax_speed.transAxes)
        ax_speed.set_yticks([])
    ax_speed.grid(axis="y", alpha=0.3)

    bars(ax_rate, variants, metric, "%.3g" if metric == "ms" else "%.0f")
    ax_rate.set_ylabel(label)
    ax_rate.legend(fontsize="small")
    ax_rate.grid(axis="y", alpha=0.3)
    ax_rate.set_xticks(xs)
    ax_rate.set_xticklabels([textwrap.fill(str(s), 22) for s in shapes], rotation=30,
                            ha="right", fontsize="small")
    title = "tilewire %s" % op
    if meta.get("gpu"):
        title += " on %s" % meta["gpu"]
    if meta.get("date"):
        title += " (%s)" % str(meta["date"]).split(" ")[0]
    fig.suptitle(title)
    fig.savefig(str(path), dpi=120)
    return path


def plot(doc, out_dir):
    """One PNG per op with timed rows into out_dir; returns their paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = doc.get("rows", [])
    paths = []
    for op in _ordered(r.get("op") for r in rows):
        # Rows that stand for a failure to run (setup-error, no timing) have nothing to draw.
        op_rows = [r for r in rows if r.get("op") == op and _positive(r.get("ms"))]
        if op_rows:
            paths.append(plot_op(op, op_rows, doc.get("meta", {}),
                                 out_dir / ("%s.png" % _safe(op))))
    return paths


# ---- command line -------------------------------------------------------------------------


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m tilewire.bench",
        description="Run tw-bench sweeps with a progress bar; print the side-by-side table;\n"
                    "write JSON and one PNG per op.",
        epilog=_bench_line(),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # a path in the epilog stays whole
    )
    p.add_argument("ops", nargs="*", help="ops to run (default: every op tw-bench lists)")
    p.add_argument("--out", default="tilewire-bench", help="output folder (default: %(default)s)")
    p.add_argument("--bench", help="path of the tw-bench executable")
    p.add_argument("--quick", action="store_true", help="each op's small sweep")
    p.add_argument("--m", help="one shape instead of the sweep (K/M/G suffixes)")
    p.add_argument("--n")
    p.add_argument("--k")
    p.add_argument("--world", help="ranks (virtual ranks when fewer GPUs)")
    p.add_argument("--sm-budget", help="SMs per rank")
    p.add_argument("--repeats", help="timed repeats per variant")
    p.add_argument("--warmup", help="untimed calls first")
    p.add_argument("--no-check", action="store_true", help="skip verifying results")
    p.add_argument("--no-plots", action="store_true", help="write no PNG")
    p.add_argument("--no-progress-bar", action="store_true", help="plain progress lines")
    p.add_argument("--plot", metavar="JSON", help="only print and plot a saved results file")
    p.add_argument("--list", action="store_true", help="list tw-bench's ops and exit")
    return p


def _passthrough(args):
    out = []
    for flag in ("m", "n", "k", "world", "sm_budget", "repeats", "warmup"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    if args.quick:
        out.append("--quick")
    if args.no_check:
        out.append("--no-check")
    return out


def _write_outputs(doc, out_dir, want_plots):
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    table = format_table(doc)
    yardstick = format_bound_table(doc)
    if yardstick:
        table += "\n" + yardstick
    (out_dir / "table.txt").write_text(table)
    sys.stdout.write("\n" + table)
    written = [json_path, out_dir / "table.txt"]
    if want_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("(matplotlib is not installed: no plots; pip install matplotlib)",
                  file=sys.stderr)
        else:
            written += plot(doc, out_dir)
    print("wrote: " + ", ".join(str(p) for p in written))


def main(argv=None):
    args = _parser().parse_args(argv)
    out_dir = pathlib.Path(args.out)
    command = "python -m tilewire.bench " + " ".join(sys.argv[1:] if argv is None else argv)

    if args.plot:
        with open(args.plot) as f:
            doc = json.load(f)
        _write_outputs(doc, out_dir, not args.no_plots)
        return 0 if all(r.get("ok", True) for r in doc.get("rows", [])) else EXIT_FAILED

    bench = find_bench(args.bench)
    if bench is None:
        print(bench_not_found(args.bench), file=sys.stderr)
        return EXIT_FAILED
    if args.list:
        return subprocess.run([str(bench), "--list"]).returncode
    available = list_ops(bench)
    names = [o[0] for o in available]
    ops = args.ops or names
    unknown = [o for o in ops if o not in names]
    if unknown:
        print("tilewire.bench: unknown op(s) %s; %s has: %s"
              % (", ".join(unknown), bench, " ".join(names) or "none"), file=sys.stderr)
        return EXIT_USAGE
    if not ops:
        print("tilewire.bench: %s lists no ops" % bench, file=sys.stderr)
        return EXIT_FAILED

    one_shape = any(getattr(args, f) is not None for f in ("m", "n", "k"))
    by_name = {o[0]: o for o in available}
    total = sum(_shape_count(by_name[o], args.quick, one_shape) for o in ops)
    passthrough = _passthrough(args)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    status = 0
    bar = _progress(total, enabled=not args.no_progress_bar)
    try:
        with open(out_dir / "tw-bench.log", "w") as log:
            for op in ops:
                rc, doc = run_op(bench, op, passthrough, out_dir, bar, log)
                results.append((op, rc, doc))
                if rc == EXIT_NO_HOPPER:
                    bar.write("tilewire.bench: tw-bench found no Hopper (sm_90) GPU")
                    return EXIT_NO_HOPPER
                if rc == EXIT_USAGE:
                    return EXIT_USAGE
                if rc != 0:
                    bar.write("tilewire.bench: %s exited with %d (see %s)"
                              % (op, rc, out_dir / "tw-bench.log"))
                    status = EXIT_FAILED
    finally:
        bar.close()
    doc = merge(results, command)
    _write_outputs(doc, out_dir, not args.no_plots)
    if any(not r.get("ok", True) for r in doc["rows"]):
        status = EXIT_FAILED
    return status


if __name__ == "__main__":
    sys.exit(main())
