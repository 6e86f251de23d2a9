"""README.md is a manual (issue #51): short, no commit hashes, both set-up commands on the first screen, and a
layout that names every package; the measurements live in docs/results.md."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PACKAGE = ROOT / "src" / "dflashkit"
MAX_LINES = 160
FIRST_SCREEN = 40


def _lines() -> list[str]:
    return README.read_text().splitlines()


def _section(title: str) -> str:
    """The body of the `## {title}` section: up to the next `## ` heading or the end."""
    lines = _lines()
    starts = [i for i, line in enumerate(lines) if line.strip() == f"## {title}"]
    assert starts, f"README.md has no '## {title}' section"
    body = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("## "):
            break
        body.append(line)
    return "\n".join(body)


def test_readme_is_short():
    n = len(_lines())
    assert n <= MAX_LINES, f"README.md has {n} lines (limit {MAX_LINES}): measurements go to docs/results.md"


def test_readme_names_no_commit():
    hashes = [(i + 1, m.group(0)) for i, line in enumerate(_lines())
              for m in re.finditer(r"(?<![0-9A-Za-z_./-])[0-9a-f]{7,40}(?![0-9A-Za-z_-])", line)
              if re.search(r"[a-f]", m.group(0)) and re.search(r"[0-9]", m.group(0))]
    assert not hashes, f"commit hashes in README.md (line, hash): {hashes}; dated measurements go to docs/results.md"


def test_both_commands_on_the_first_screen():
    head = "\n".join(_lines()[:FIRST_SCREEN])
    for command in ("make demo", "make test"):
        assert re.search(rf"(?<![\w-]){command}(?![\w-])", head), f"`{command}` is not in README.md's first {FIRST_SCREEN} lines"


def test_layout_names_every_package():
    layout = _section("Layout")
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert len(packages) > 10, packages  # the scan found the package tree
    missing = [p for p in packages if f"{p}/" not in layout]
    assert not missing, f"README.md's Layout section does not name {missing} (as `name/`)"


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert any(link.startswith("docs/") for link in links)  # the scan sees the links
    broken = []
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        if not target.is_file() or (anchor and anchor not in _anchors(target)):
            broken.append(link)
    assert not broken, f"README.md links to missing files or headings: {broken}"


def test_results_are_in_docs():
    results = (ROOT / "docs" / "results.md").read_text()
    assert "docs/results.md" in README.read_text()
    for kind in ("Zen 4", "AMX", "AVX2"):
        assert kind in results, f"docs/results.md has no table for the {kind} CPU kind"
