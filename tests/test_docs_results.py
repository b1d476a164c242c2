"""docs/results holds the raw output of measurements the docs quote: a file no page cites is
noise a reader cannot place, so each must be named by a page of docs/ or the README, by its
name, a shell brace list (``peer-{exact,int8}-6cdf672.json``) or a glob (``*-d7a1a79.json``)."""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
CITATION = re.compile(r"results/([A-Za-z0-9_.{},*-]+\.json)")


def expand_braces(pattern: str) -> list[str]:
    """``a-{x,y}-{1,2}.json`` -> the four names, as a shell expands them."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def cited_patterns(pages: list[Path]) -> set[str]:
    return {name for page in pages for match in CITATION.findall(page.read_text())
            for name in expand_braces(match)}


def uncited(results: Path, pages: list[Path]) -> list[str]:
    patterns = cited_patterns(pages)
    return sorted(path.name for path in results.iterdir()
                  if not any(fnmatch.fnmatchcase(path.name, pattern) for pattern in patterns))


def test_every_results_file_is_cited_by_a_page():
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    missing = uncited(RESULTS, pages)
    assert not missing, f"docs/results files no page cites (cite them where their figures are quoted, or delete " \
                        f"them): {missing}"


def test_a_citation_may_list_or_glob_its_files(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name in ("peer-exact-abc.json", "peer-int8-abc.json", "tp-d7.json", "old.json"):
        (results / name).write_text("{}")
    page = tmp_path / "page.md"
    page.write_text("see docs/results/peer-{exact,int8}-abc.json and docs/results/*-d7.json.")
    assert uncited(results, [page]) == ["old.json"]
