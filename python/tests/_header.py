"""A small parser of include/tilewire.h: enough of C to list its functions (with return and
parameter types), enums, structs (field names in order) and integer #defines, so tests can
check that the Python binding mirrors all of it."""

import re


def strip(text):
    """The header without comments and preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    lines = []
    continued = False
    for line in text.splitlines():
        if continued or line.lstrip().startswith("#"):
            continued = line.rstrip().endswith("\\")
            continue
        lines.append(line)
    return "\n".join(lines)


def defines(text):
    """Integer-literal #defines: name -> value."""
    out = {}
    for m in re.finditer(r"^\s*#define\s+(TW_\w+)\s+(\d+)\s*$", text, flags=re.M):
        out[m.group(1)] = int(m.group(2))
    return out


def _split_type_name(decl):
    """'const char **name' -> ('char', 2) and 'name' (const dropped, array dims dropped)."""
    decl = re.sub(r"\[[^\]]*\]", "", decl)
    names = re.findall(r"[A-Za-z_]\w*", decl)
    name = names[-1]
    type_part = decl[: decl.rfind(name)]
    stars = type_part.count("*")
    words = [w for w in re.findall(r"[A-Za-z_]\w*", type_part) if w != "const"]
    return " ".join(words), stars, name


def functions(text):
    """name -> {"ret": (base, stars), "params": [(base, stars, name), ...]}"""
    body = strip(text)
    out = {}
    pattern = r"\bTW_API\s+([^;{}()]*?)\b(tw_\w+)\s*\(([^)]*)\)\s*;"
    for m in re.finditer(pattern, body, flags=re.S):
        ret_text, name, params_text = m.group(1), m.group(2), m.group(3).strip()
        ret_words = [w for w in re.findall(r"[A-Za-z_]\w*", ret_text) if w != "const"]
        ret = (" ".join(ret_words), ret_text.count("*"))
        params = []
        if params_text and params_text != "void":
            for p in params_text.split(","):
                params.append(_split_type_name(p.strip()))
        out[name] = {"ret": ret, "params": params}
    return out


def enums(text):
    """typedef name -> {constant: value} (every constant has an explicit value in tilewire.h)."""
    body = strip(text)
    out = {}
    for m in re.finditer(r"typedef\s+enum\s+\w*\s*\{(.*?)\}\s*(\w+)\s*;", body, flags=re.S):
        values = {}
        for entry in m.group(1).split(","):
            entry = entry.strip()
            if not entry:
                continue
            name, _, value = entry.partition("=")
            values[name.strip()] = int(value.strip(), 0)
        out[m.group(2)] = values
    return out


def structs(text):
    """typedef name -> [field names in order] for `typedef struct ... { ... } name;`."""
    body = strip(text)
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+\w*\s*\{(.*?)\}\s*(\w+)\s*;", body, flags=re.S):
        fields = []
        for decl in m.group(1).split(";"):
            decl = decl.strip()
            if not decl:
                continue
            parts = decl.split(",")
            _, _, first = _split_type_name(parts[0])
            fields.append(first)
            for extra in parts[1:]:
                fields.append(re.sub(r"[\s*]|\[.*?\]", "", extra))
        out[m.group(2)] = fields
    return out
