"""What `pip install kerasmulti` ships: every module, and the type marker (no TensorFlow here)."""

from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[1]


def test_every_folder_of_modules_is_a_package_that_setuptools_finds():
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "kerasmulti").rglob("*.py")
    }
    found = set(setuptools.find_packages(str(ROOT), include=["kerasmulti*"]))
    assert folders <= found, f"not installed by setup.cfg's packages = find: {sorted(folders - found)}"


def test_the_package_says_it_is_typed():
    assert (ROOT / "kerasmulti" / "py.typed").is_file()
    assert "kerasmulti = py.typed" in (ROOT / "setup.cfg").read_text()


def test_no_module_is_over_400_lines():
    # One idea a module: a module that outgrows this holds two (issue #25's rule).
    long = {str(path.relative_to(ROOT)): n for path in (ROOT / "kerasmulti").rglob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long
