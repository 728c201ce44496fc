#!/usr/bin/env python3
"""Every relative link in README.md and docs/*.md resolves inside the repository.

    python3 tests/python/test_doc_links.py <flux8 binary, unused> <source dir>

A link [text](target) or image ![alt](target) whose target is not a URL must name a file or
folder that exists inside the source directory, and a `#fragment` on a Markdown file must name
one of its headings (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens).
Links inside code blocks and inline code are not links. A Markdown file named anywhere in the
text (`docs/FP8.md`, MEMORY.md) must exist beside the file, at the repository root or in docs/
(except inside an inline `git ...` command, which may name files that only git history holds).
Standard library only; exits non-zero naming every broken link.
"""
import os
import re
import sys

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def prose_lines(text):
    """The lines outside fenced code blocks, with inline code removed, and their numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, INLINE_CODE.sub("", line)


def anchors(text):
    """GitHub's heading anchors of a Markdown text."""
    seen, out = {}, set()
    for _, line in prose_lines(text.replace("`", "")):
        m = HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path, text, root):
    """(line, target, why) for every relative link of `text` (the file at `path`) that fails."""
    root = os.path.realpath(root)
    problems = []
    for number, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            resolved = os.path.realpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if resolved != root and not resolved.startswith(root + os.sep):
                problems.append((number, target, "points outside the repository"))
                continue
            if not os.path.exists(resolved):
                problems.append((number, target, "no such file"))
                continue
            if fragment and resolved.endswith(".md"):
                if file_part:
                    with open(resolved, encoding="utf-8") as f:
                        headings = anchors(f.read())
                else:
                    headings = anchors(text)
                if fragment not in headings:
                    problems.append((number, target, f"no heading with anchor #{fragment}"))
    return problems


GIT_COMMAND = re.compile(r"`git [^`]*`")
MENTION = re.compile(r"(?<![\w/.#-])((?:\.\.?/)*(?:[\w-]+/)*[\w-]+\.md)\b")


def broken_mentions(path, text, root):
    """(line, name, why) for every Markdown file named in prose or code (docs/FP8.md, MEMORY.md)
    that exists neither beside `path`, nor under the repository root, nor under docs/."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        line = GIT_COMMAND.sub("", line)  # a git command may name what git history holds
        for name in MENTION.findall(line):
            bases = (os.path.dirname(path), root, os.path.join(root, "docs"))
            if not any(os.path.exists(os.path.join(b, name)) for b in bases):
                problems.append((number, name, "names a Markdown file that is not in the repository"))
    return problems


def self_check(root):
    """The checker itself finds a missing file, a missing anchor and a link outside the tree."""
    readme = os.path.join(root, "README.md")
    text = "# Title\n[ok](#title) [gone](docs/no_such_file.md) [bad](#nowhere) [out](../../x.md)\n```\n[code](nope.md)\n```\n"
    found = sorted(t for _, t, _ in broken_links(readme, text, root))
    expected = sorted(["docs/no_such_file.md", "#nowhere", "../../x.md"])
    if found != expected:
        sys.exit(f"test_doc_links: the checker itself is wrong: found {found}, expected {expected}")
    mentioned = [n for _, n, _ in broken_mentions(readme, "see docs/FP8.md and NO_SUCH_DOC.md, or MEMORY.md", root)]
    if mentioned != ["NO_SUCH_DOC.md"]:
        sys.exit(f"test_doc_links: the mention checker itself is wrong: found {mentioned}, expected [NO_SUCH_DOC.md]")


def main(argv):
    root = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    root = os.path.realpath(root)
    self_check(root)
    docs = os.path.join(root, "docs")
    files = [os.path.join(root, "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    failures = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for number, target, why in broken_links(path, text, root) + broken_mentions(path, text, root):
            failures.append(f"{os.path.relpath(path, root)}:{number}: ({target}) {why}")
    if failures:
        print("broken links (fix the target or the link):", *failures, sep="\n  ")
        return 1
    print(f"test_doc_links: {len(files)} files, every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
