"""The ``JGPTQ_*`` environment variables: jgptq.environment lists every one the package reads, each where it is
read, and README's "Environment variables" section is that list."""

import re
from pathlib import Path

from jgptq.environment import OVERRIDES, markdown_table

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bJGPTQ_[A-Z0-9_]*[A-Z0-9]\b")


def package_sources():
    for package in ("jgptq", "jgptq_torch"):
        yield from sorted((ROOT / package).rglob("*.py"))


def test_every_variable_the_package_names_is_listed_once():
    named = {m for path in package_sources() for m in NAME.findall(path.read_text())}
    listed = [o.name for o in OVERRIDES]
    assert len(listed) == len(set(listed))
    assert named == set(listed)


def test_each_variable_is_read_from_the_environment_where_the_list_says():
    for override in OVERRIDES:
        source = (ROOT / override.read_in).read_text()
        assert f'"{override.name}"' in source, override
        assert "os.environ" in source, override


def test_the_readme_section_is_the_list():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    assert markdown_table() in section
    rows = [line for line in section.splitlines() if line.startswith("| `JGPTQ_")]
    assert [row.split("`")[1] for row in rows] == [o.name for o in OVERRIDES]
