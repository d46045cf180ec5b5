"""The README, the changelog and the docs pages.

Every link resolves inside the repository, every file a page names exists, and the
reference pages in docs/ say what the code does now (history goes to CHANGELOG.md).
"""

import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *REFERENCE]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A file of the repository named in a code span: `tests/cases.py`, `bench_gpu.py`.
FILE = re.compile(r"`([\w./-]+\.(?:py|ipynb|md|txt|cfg|toml))`")
# Files a page tells the reader to write, not files of the repository.
READERS_FILES = {"train.py"}


def _anchors(page: Path) -> set:
    """GitHub's anchors for the headings of a Markdown page."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: link to a missing file: {target}"
        assert ROOT in resolved.parents or resolved == ROOT, f"{page.name}: link outside the repository: {target}"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"


def test_the_readme_is_the_pitch_and_the_reference_is_in_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 10_000
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", quickstart, re.S)[0].strip().splitlines()
    assert len(commands) == 2 and commands[0].endswith("kerasmulti demo") and commands[1].endswith("python -m pytest")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, f"the README does not link docs/{page.name}"


@functools.cache
def _repository_files() -> dict:
    """Every file of the working tree, by name (hidden folders, caches and builds aside)."""
    names = {}
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not (d.startswith(".") or d in ("__pycache__", "build") or d.endswith(".egg-info"))]
        for name in files:
            names.setdefault(name, []).append(Path(folder) / name)
    return names


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "CHANGELOG.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_names_exists(page):
    """A file named in a code span, by path (from the page or the repository root) or by name.

    CHANGELOG.md is exempt: its history names files as they were then.
    """
    files = _repository_files()
    missing = []
    for name in sorted(set(FILE.findall(page.read_text())) - READERS_FILES):
        if "/" in name:
            if not ((page.parent / name).exists() or (ROOT / name).exists()):
                missing.append(name)
        elif name not in files:
            missing.append(name)
    assert not missing, f"{page.name} names files that do not exist (moved or renamed?): {missing}"


# History and test narration belong in CHANGELOG.md; the reference says what the code does now.
NARRATION = re.compile(
    r"\b(?:20\d\d-\d\d-\d\d|we measured|in session|(?:\(|\b)tested (?:with|by|on|for)|"
    r"a test (?:ends|checks|kills)|the test checks|tests (?:trace|compare|check)|as before|before this change|"
    r"kerasmulti \d+\.\d+)",
    re.I,
)


@pytest.mark.parametrize("page", [p for p in REFERENCE if p.name != "benchmarks.md"], ids=lambda p: p.name)
def test_reference_pages_hold_no_history(page):
    """Dates, earlier versions and how a claim was tested go to CHANGELOG.md.

    docs/benchmarks.md is exempt: a measured figure is reference, with its date.
    """
    found = [f"{number}: {line.strip()}" for number, line in enumerate(page.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert not found, f"{page.name}: move these to CHANGELOG.md:\n" + "\n".join(found)


_NUMBERS = {word: n for n, word in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}


def test_the_readmes_counts_of_model_kinds_and_batch_shapes_are_the_conformance_suites():
    """The README's "tested on N model kinds, M batch shapes", read from the suite's files (no TensorFlow)."""
    found = re.search(r"tested on (\w+) model kinds, (\w+) batch\s+shapes", (ROOT / "README.md").read_text())
    assert found, "the README no longer says how many model kinds and batch shapes are tested"
    cases = (ROOT / "tests" / "cases.py").read_text()
    listed = re.search(r"^CASES = \[(.*?)^\]", cases, re.S | re.M).group(1)
    batch_sizes = re.search(r"^BATCH_SIZES = \[(.*?)\]", (ROOT / "tests" / "data_parallel" / "test_conformance.py").read_text(), re.M).group(1)
    assert _NUMBERS[found.group(1)] == listed.count("Case("), found.group(0)
    assert _NUMBERS[found.group(2)] == len(batch_sizes.split(",")), found.group(0)
