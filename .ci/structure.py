#!/usr/bin/env python3
"""Checks the shape of src/: no file over 700 lines, no function over 100
lines (tests aside), and no import cycle between top-level modules.

Functions are found by brace matching from each `fn` line, with strings,
chars and comments skipped; a `#[cfg(test)] mod tests` block is ignored.
"""
import os
import re
import sys

MAX_FILE_LINES = 700
MAX_FN_LINES = 100
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def strip(text):
    """The text with comments, strings and char literals blanked (lines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"' or (c == "r" and re.match(r'r#*"', text[i:])):
            m = re.match(r'r(#*)"', text[i:])
            if m:
                end = '"' + m.group(1)
                j = text.find(end, i + len(m.group(0)))
                j = n if j < 0 else j + len(end)
            else:
                j = i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:]):
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def closing_brace(code, start):
    """Index of the `}` closing the `{` at `start` (comments and strings stripped)."""
    depth = 0
    for j in range(start, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code)


def test_blocks(code):
    """Line ranges of `#[cfg(test)]` items."""
    ranges = []
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*\{", code):
        j = closing_brace(code, m.end() - 1)
        ranges.append((code.count("\n", 0, m.start()), code.count("\n", 0, j)))
    return ranges


def functions(code):
    for m in re.finditer(r"\bfn\s+(\w+)[^;{]*\{", code):
        j = closing_brace(code, m.end() - 1)
        first = code.count("\n", 0, m.start())
        last = code.count("\n", 0, j)
        yield m.group(1), first, last


def main():
    problems = []
    deps = {}
    for dirpath, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT)
            text = open(path, encoding="utf-8").read()
            lines = text.count("\n")
            if lines > MAX_FILE_LINES:
                problems.append(f"{rel}: {lines} lines (limit {MAX_FILE_LINES})")
            code = strip(text)
            tests = test_blocks(code)
            for fname, first, last in functions(code):
                if any(a <= first <= b for a, b in tests):
                    continue
                if last - first + 1 > MAX_FN_LINES:
                    problems.append(f"{rel}:{first + 1}: fn {fname} is {last - first + 1} lines (limit {MAX_FN_LINES})")
            if rel.startswith("bin/"):
                continue
            top = rel.split(os.sep)[0].removesuffix(".rs")
            body = code
            for a, b in reversed(tests):
                body_lines = body.split("\n")
                body = "\n".join(body_lines[:a] + body_lines[b + 1 :])
            for used in re.findall(r"\bcrate::(\w+)", body):
                if used != top:
                    deps.setdefault(top, set()).add(used)
            if rel.count(os.sep) >= 1:
                for used in re.findall(r"\bsuper::super::(\w+)", body):
                    pass
    # Cycles between top-level modules.
    for start in sorted(deps):
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(deps.get(node, ())):
                if nxt == start and len(path) > 1:
                    problems.append("import cycle: " + " -> ".join(path + [start]))
                elif nxt not in seen and nxt in deps:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    cycles = sorted({p for p in problems if p.startswith("import cycle")})
    others = [p for p in problems if not p.startswith("import cycle")]
    for p in others + cycles:
        print(p)
    if others or cycles:
        sys.exit(1)
    print(f"structure ok: files <= {MAX_FILE_LINES} lines, functions <= {MAX_FN_LINES}, no module cycle")


if __name__ == "__main__":
    main()
