#!/usr/bin/env python3
"""Compares the device code of two builds of libtilewire function by function.

Usage: sass-compare.py OLD.so NEW.so   (cuobjdump and nvdisasm on PATH)

Each kernel's SASS is taken from `cuobjdump -sass`, with the function's own name and the
names it refers to replaced by a placeholder, so a function that moved to another file or
namespace still matches. Prints the functions present on one side only and those whose
bodies differ; exits 0 when the two sets of bodies are identical, 1 otherwise.
"""
import collections
import re
import subprocess
import sys


def functions(lib):
    out = subprocess.run(["cuobjdump", "-sass", lib], check=True, capture_output=True,
                         text=True).stdout
    funcs, name, body = {}, None, []
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                funcs[name] = body
            name, body = m.group(1), []
        elif name and line.strip().startswith("/*"):
            # cuobjdump pads every line to the widest instruction of the file: spacing is noise
            body.append(" ".join(line.split()))
    if name:
        funcs[name] = body
    return funcs


def normalise(body, names):
    text = "\n".join(body)
    for n in sorted(names, key=len, reverse=True):
        text = text.replace(n, "<fn>")
    return re.sub(r"\(\*\"[^\"]*\"\*\)", "<sym>", text)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = functions(sys.argv[1]), functions(sys.argv[2])
    names = set(old) | set(new)
    count = lambda fs: collections.Counter(normalise(b, names) for b in fs.values())
    co, cn = count(old), count(new)
    by_body_old = {normalise(b, names): n for n, b in old.items()}
    by_body_new = {normalise(b, names): n for n, b in new.items()}
    only_old = co - cn
    only_new = cn - co
    for body in only_old:
        print("old only:", by_body_old[body])
    for body in only_new:
        print("new only:", by_body_new[body])
    print("%d functions old, %d new, %d bodies differ" %
          (len(old), len(new), sum(only_old.values()) + sum(only_new.values())))
    return 1 if only_old or only_new else 0


if __name__ == "__main__":
    sys.exit(main())
