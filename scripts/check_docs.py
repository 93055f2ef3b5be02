#!/usr/bin/env python3
"""Keeps the docs true to the tree: run by scripts/test.sh before the build.

    python3 scripts/check_docs.py            # every Markdown file of the repository
    python3 scripts/check_docs.py README.md  # these files only

Fails (exit 1, one line per problem: file:line: what) when
- a relative link or image ([text](path), ![alt](path)) does not resolve
  from the file that holds it (anchors and http(s)/mailto links are not checked);
- a path the text names under scripts/, configs/, microbench/, tests/, src/,
  include/, examples/, python/, docs/, cmake/ or third_party_notes/ does not
  exist (brace lists {a,b} and globs are expanded; names with <placeholders>
  are skipped; a command's output, --benchmark_out=FILE or --out FILE, is not checked);
- a build/ path names something the build does not make: its last part must
  be a CMake target (add_executable / add_library / nanobind_add_module) or the
  path must appear in a script under scripts/ (build/venv-python);
- a script or config named without a folder (`train_ab.py`, `smoke_vocab_f32.yaml`)
  is no file of the repository.
Standard library only, a fraction of a second.
"""
import glob
import itertools
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", "node_modules", "venv", ".venv", "__pycache__"}
TREE_PREFIXES = ("scripts", "configs", "microbench", "tests", "src", "include", "examples", "python", "docs",
                 "cmake", "third_party_notes")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"(?<![\w./~-])((?:" + "|".join(TREE_PREFIXES + ("build",)) + r")/[\w./{},*<>+=-]*)")
BARE_FILE = re.compile(r"`([\w.+-]+\.(?:py|sh|yaml|cmake))`")
OUTPUT_ARG = re.compile(r"--(?:benchmark_)?out[= ]\S+")
TARGET = re.compile(r"(?:add_executable|add_library|nanobind_add_module)\(\s*([\w.+-]+)")


def markdown_files():
    for root, dirs, names in os.walk(ROOT):
        rel = os.path.relpath(root, ROOT)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")
                         and not (rel == "python" and d == "build") and not d.endswith(".egg-info"))
        for name in sorted(names):
            if name.endswith(".md"):
                yield os.path.join(root, name)


def all_files():
    out = []
    for root, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")]
        out.extend(os.path.join(root, n) for n in names)
    return out


def expand_braces(text):
    m = re.search(r"\{([^{}]*)\}", text)
    if not m:
        return [text]
    return list(itertools.chain.from_iterable(
        expand_braces(text[:m.start()] + alt + text[m.end():]) for alt in m.group(1).split(",")))


def exists(rel):
    for candidate in expand_braces(rel):
        path = os.path.join(ROOT, candidate)
        if any(c in candidate for c in "*?[") and glob.glob(path):
            continue
        if not os.path.exists(path):
            return False
    return True


def cmake_targets():
    targets = set()
    for path in all_files():
        if os.path.basename(path) == "CMakeLists.txt" or path.endswith(".cmake"):
            with open(path, errors="replace") as f:
                targets.update(TARGET.findall(f.read()))
    return targets


def scripts_text():
    text = ""
    for path in glob.glob(os.path.join(ROOT, "scripts", "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                text += f.read()
    return text


def check(path, targets, scripts, basenames):
    problems = []
    rel_file = os.path.relpath(path, ROOT)
    with open(path, errors="replace") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        where = f"{rel_file}:{number}"
        for target in LINK.findall(line):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
            if not os.path.exists(resolved):
                problems.append(f"{where}: link '{target}' does not resolve ({os.path.relpath(resolved, ROOT)})")
        # What a command writes (--benchmark_out=FILE, --out FILE) need not exist yet.
        for found in PATH.findall(OUTPUT_ARG.sub("", line)):
            found = found.rstrip(".,:;)")
            if "<" in found or ">" in found or "..." in found:
                continue
            if found.startswith("build/"):
                last = found.rstrip("/").split("/")[-1]
                if found == "build/" or last in targets or found.rstrip("/") in scripts:
                    continue
                problems.append(f"{where}: '{found}' is neither a CMake target nor a path a script makes")
            elif not exists(found):
                problems.append(f"{where}: '{found}' does not exist")
        for name in BARE_FILE.findall(line):
            if "/" not in name and name not in basenames:
                problems.append(f"{where}: '{name}' is no file of the repository")
    return problems


def main(args):
    files = [os.path.abspath(a) for a in args] if args else list(markdown_files())
    targets = cmake_targets()
    scripts = scripts_text()
    basenames = {os.path.basename(p) for p in all_files()}
    problems = []
    for path in files:
        problems.extend(check(path, targets, scripts, basenames))
    for p in problems:
        print(p)
    print(f"check_docs: {len(files)} files, {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
