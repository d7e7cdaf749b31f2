#!/usr/bin/env python3
"""Size check: source files of at most 800 lines, functions of at most 150.

    scripts/check-sizes.py                  check the tree (CI, ctest check_sizes)
    scripts/check-sizes.py --list           print every offender, the exceptions ignored
    scripts/check-sizes.py --write-exceptions   rewrite scripts/size-exceptions.txt from the tree

Checked: the tracked *.c *.h *.cu *.cuh *.py under src/ include/ tools/ tests/ python/.
A file whose opening comment (or docstring) has a line starting with "Size:" that gives a
reason is exempt. Functions: in C and CUDA the top-level brace blocks whose header has a '('
(not struct, union, enum, namespace, extern "C" or an initializer), from the first line of the
signature (template line included) to the closing brace; in Python every def, methods and
nested functions included, from the def line to its last line.

scripts/size-exceptions.txt lists the offenders the tree still has, one a line ("PATH file"
or "PATH function NAME"). The check fails on an offender not listed and on a listed entry that
no longer offends, so the list only shrinks: split the file or function, then delete its line.
"""

import argparse
import ast
import os
import re
import subprocess
import sys

FILE_LIMIT = 800
FUNCTION_LIMIT = 150
ROOTS = ("src", "include", "tools", "tests", "python")
SUFFIXES = (".c", ".h", ".cu", ".cuh", ".py")
EXCEPTIONS = os.path.join("scripts", "size-exceptions.txt")


def tracked_files(root):
    """The tracked source files under ROOTS (every file there when this is no git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *ROOTS], cwd=root, check=True,
                             capture_output=True).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for top in ROOTS:
            for d, dirs, names in os.walk(os.path.join(root, top)):
                dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
                paths += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(p for p in paths if p.endswith(SUFFIXES) and os.path.isfile(os.path.join(root, p)))


def opening_comment(lines, python):
    """The lines of the file's opening comment (C block or // lines, Python docstring or #)."""
    text = []
    i = 0
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith("#!")):
        i += 1
    if i == len(lines):
        return text
    first = lines[i].strip()
    if python and first[:3] in ('"""', "'''"):
        quote = first[:3]
        body = first[3:]
        while True:
            end = body.find(quote)
            text.append(body if end < 0 else body[:end])
            i += 1
            if end >= 0 or i == len(lines):
                return text
            body = lines[i]
    leader = "#" if python else "//"
    if first.startswith(leader):
        while i < len(lines) and lines[i].strip().startswith(leader):
            text.append(lines[i].strip()[len(leader):])
            i += 1
        return text
    if not python and first.startswith("/*"):
        body = first[2:]
        while True:
            end = body.find("*/")
            text.append(body if end < 0 else body[:end])
            i += 1
            if end >= 0 or i == len(lines):
                return text
            body = lines[i]
    return text


def has_size_reason(lines, python):
    for line in opening_comment(lines, python):
        line = line.strip().lstrip("*").strip()
        if line.startswith("Size:") and line[5:].strip():
            return True
    return False


def strip_c(text):
    """C/CUDA text with comments, strings and character literals blanked (newlines kept) and
    preprocessor lines (with their continuations) emptied."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":
            # a directive: up to the end of the line, continuations included
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append("\n")
                    i += 2
                    continue
                i += 1
            continue
        line_start = False
        if c == "\n":
            line_start = True
            out.append(c)
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(" " + "\n" * text.count("\n", i, end))
            i = end
        elif c in "\"'":
            # a C++14 digit separator (1'000) is no character literal
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


TRANSPARENT = re.compile(r"^\s*(namespace\b[^(]*|extern\s*\"\")\s*$")
TRAILING = re.compile(r"(\s+(const|noexcept|override|final|volatile|mutable)|\s*->\s*[\w:<>,\s*&]+)\s*$")


def drop_templates(head):
    """head without its template <...> parameter lists (nested <> included)."""
    out, i = [], 0
    for m in re.finditer(r"\btemplate\s*<", head):
        if m.start() < i:
            continue
        out.append(head[i:m.start()])
        j, level = m.end(), 1
        while j < len(head) and level:
            level += {"<": 1, ">": -1}.get(head[j], 0)
            j += 1
        i = j
    out.append(head[i:])
    return "".join(out)


def is_function_header(head):
    """A function definition's header: it ends with its parameter list (and qualifiers), and
    has no '=' outside parentheses (an initializer). Struct, union, enum and class
    definitions end with a name or a base list instead."""
    head = drop_templates(head).strip()
    while True:
        cut = TRAILING.sub("", head)
        if cut == head:
            break
        head = cut
    if not head.endswith(")"):
        return False
    level = 0
    for ch in head:
        level += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "=" and level == 0:
            return False
    return True


SKIP_NAMES = {"__launch_bounds__", "__attribute__", "__align__", "alignas", "__declspec",
              "decltype", "sizeof", "__cluster_dims__", "TW_API"}


def function_name(header):
    for m in re.finditer(r"([A-Za-z_~][A-Za-z_0-9:~]*|operator\s*\S+?)\s*\(", header):
        name = m.group(1)
        if name.split("::")[-1] not in SKIP_NAMES:
            return name
    return "?"


def c_functions(text):
    """(name, first line, line count) of the top-level functions of C/CUDA source text."""
    code = strip_c(text)
    found = []
    depth = 0           # brace depth below the innermost namespace / extern "C" block
    transparent = []    # depth stack of the namespace / extern "C" blocks we are in
    header = []         # top-level text since the last statement end: (line, text)
    block = None        # (name, first line) of the function being read, or None
    line = 1
    for ch in code:
        if ch == "\n":
            line += 1
        if depth == 0:
            if ch == "{":
                head = "".join(t for _, t in header)
                first = next((ln for ln, t in header if not t.isspace()), line)
                if TRANSPARENT.match(head):
                    transparent.append(depth)
                    header = []
                    continue
                depth = 1
                if is_function_header(head):
                    block = (function_name(head), first)
                else:
                    block = None
                header = []
            elif ch == "}" and transparent:
                transparent.pop()
                header = []
            elif ch == ";":
                header = []
            else:
                header.append((line, ch))
        else:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    if block:
                        found.append((block[0], block[1], line - block[1] + 1))
                    block = None
                    header = []
    return found


def py_functions(text, path):
    try:
        tree = ast.parse(text, path)
    except SyntaxError as e:
        print(f"{path}:{e.lineno}: cannot parse: {e.msg}", file=sys.stderr)
        return []
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def offenders(root):
    """(key, message) of every file and function over its limit, files with a Size: reason aside."""
    result = []
    for path in tracked_files(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        lines = text.splitlines()
        python = path.endswith(".py")
        if has_size_reason(lines, python):
            continue
        if len(lines) > FILE_LIMIT:
            result.append((f"{path} file", f"{path}: {len(lines)} lines (limit {FILE_LIMIT})"))
        funcs = py_functions(text, path) if python else c_functions(text)
        for name, first, count in funcs:
            if count > FUNCTION_LIMIT:
                result.append((f"{path} function {name}",
                               f"{path}:{first}: function {name} is {count} lines (limit {FUNCTION_LIMIT})"))
    return result


def read_exceptions(path):
    entries = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line:
                    entries.append(" ".join(line.split()))
    return entries


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--list", action="store_true", help="print every offender, listed or not")
    ap.add_argument("--write-exceptions", action="store_true",
                    help="rewrite the exceptions file from today's offenders")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    found = offenders(root)
    exceptions_path = os.path.join(root, EXCEPTIONS)
    if args.list:
        for _, msg in found:
            print(msg)
        return 0
    if args.write_exceptions:
        keys = sorted({key for key, _ in found})
        with open(exceptions_path, "w", encoding="utf-8") as f:
            f.write("# Offenders of scripts/check-sizes.py that the tree still has: one a line, \"PATH file\"\n"
                    "# or \"PATH function NAME\". Split the file or function, then delete its line;\n"
                    "# a file that must stay large says why in a \"Size:\" line of its opening comment.\n")
            f.writelines(k + "\n" for k in keys)
        print(f"{EXCEPTIONS}: {len(keys)} entries")
        return 0
    listed = read_exceptions(exceptions_path)
    keys = {key for key, _ in found}
    failed = 0
    for key, msg in found:
        if key not in listed:
            print(msg)
            failed += 1
    for key in listed:
        if key not in keys:
            print(f"{EXCEPTIONS}: \"{key}\" is within the limits now (or gone): delete its line")
            failed += 1
    excused = len([k for k in keys if k in listed])
    print(f"check-sizes: {failed} problem(s); {excused} known offender(s) listed in {EXCEPTIONS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
