"""The docs describe the system as it is: performance.md stays a results section (at most 400 lines), no doc reads
as a diary (stop numbers, commit hashes, dates, issue numbers as titles, "Next" plans), and links between docs land."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]

PERFORMANCE_MAX_LINES = 400

# A hex token of 7-40 characters with a digit and a letter a-f, not part of a path, name or number.
COMMIT_HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
# Commits of other projects that a doc pins so that its figures can be reproduced.
EXTERNAL_PINS = {"05a90d7": "the MindSpeed-RL commit whose configs docs/plan.md's recipe table plans"}
DIARY = [
    (re.compile(r"(?i)\bstop \d+"), "a work-session number ('stop NN')"),
    (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "a date"),
    (re.compile(r"(?i)\bthis session\b"), "'this session'"),
    (re.compile(r"(?i)^#+ .*\bissue \d+"), "an issue number in a title"),
    (re.compile(r"(?i)^#+ *(next|built now|not done( yet)?)\b"), "a plan or progress heading"),
    (re.compile(r"(?i)^next:"), "a 'Next:' plan"),
]


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(path: str) -> list[str]:
    """The doc's headings, outside fenced code blocks."""
    out, fenced = [], False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _headings(path):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_performance_md_is_a_results_section():
    lines = open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {len(lines)} lines, more than {PERFORMANCE_MAX_LINES}: keep one current figure per "
        "measurement (command, machine) and leave superseded ones to the commit log"
    )


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_docs_read_as_today_not_as_a_diary(path):
    found = []
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        for pattern, what in DIARY:
            if pattern.search(line):
                found.append(f"{_rel(path)}:{n}: {what}: {line.strip()[:100]}")
        for m in COMMIT_HASH.finditer(line):
            if m.group(0) not in EXTERNAL_PINS:
                found.append(f"{_rel(path)}:{n}: a commit hash {m.group(0)}: {line.strip()[:100]}")
    assert not found, "diary language (history belongs in the commit log):\n" + "\n".join(found)


def test_the_diary_patterns_catch_what_they_name():
    """A check that finds nothing must be able to find something: each pattern on a line it exists for."""
    samples = {
        "## Fused kernels (2026-11-27, stop 38; HEAD 9db601d)": 3,
        "# Asynchronous RL (issue 48): samplers": 1,
        "## Built now": 1,
        "Next: an lr decay": 1,
        "measured this session": 1,
    }
    for line, hits in samples.items():
        n = sum(bool(p.search(line)) for p, _ in DIARY) + len(COMMIT_HASH.findall(line))
        assert n == hits, (line, n)
    for clean in ("configs/ppo_qwen25_7b_A3.yaml", "4294967296", "the stop token", "sha256 0123abc-def", "e2e"):
        assert not any(p.search(clean) for p, _ in DIARY) and not COMMIT_HASH.search(clean), clean


def test_links_between_docs_land():
    """Every relative markdown link names an existing file, and its #anchor a heading there; every
    `docs/<doc>.md, "Title"` citation in the docs, code, tools and configs names a heading of X."""
    broken = []
    for path in DOCS + [os.path.join(ROOT, "tests", "README.md")]:
        text = open(path, encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(dest):
                broken.append(f"{_rel(path)}: ({target}): no file {_rel(dest)}")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                broken.append(f"{_rel(path)}: ({target}): no heading with anchor #{anchor} in {_rel(dest)}")
    cited = re.compile(r"docs/(\w+\.md),? \"([^\"]+)\"")
    sources = [
        p
        for d in ("mindrl", "tools", "tests", "configs", "examples", "docs")
        for p in glob.glob(os.path.join(ROOT, d, "**", "*"), recursive=True)
        if os.path.isfile(p)
    ] + DOCS
    for path in sources:
        if not path.endswith((".py", ".sh", ".yaml", ".md")):
            continue
        for n, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
            for doc, title in cited.findall(line):
                target = os.path.join(ROOT, "docs", doc)
                if not os.path.exists(target):
                    broken.append(f"{_rel(path)}:{n}: docs/{doc} does not exist")
                elif not any(h.lower().startswith(title.lower()) for h in _headings(target)):
                    broken.append(f'{_rel(path)}:{n}: docs/{doc} has no heading "{title}"')
    assert not broken, "\n".join(broken)
