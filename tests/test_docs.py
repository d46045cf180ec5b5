"""The README and the docs pages: every link resolves, nothing points outside the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


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
