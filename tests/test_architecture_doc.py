"""docs/ARCHITECTURE.md, the map, and the area pages beside it stay true to the code: every design
rule the code cites has a heading in the map with its number; every path a page names exists, and
every type a page places in a module is defined there; the map stays short enough to read in one
sitting, names every area page, and every link between the pages reaches a heading that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOC = DOCS / "ARCHITECTURE.md"  # the map
AREA_PAGES = ("cache.md", "speculative.md", "kernels.md", "cluster.md")  # the detail, next to what it describes
PAGES = (DOC, *(DOCS / name for name in AREA_PAGES))
MAP_MAX_LINES = 450
CITING = ("cairn", "benchmarks", "tests")
ROOT_FILE_SUFFIXES = (".py", ".md", ".toml", ".yaml", ".yml", ".sh")

# "design rule 4", "rule 7", "rules 2-8", "rules 2–8", "rules 1, 4 and 5"
CITATION = re.compile(r"\brules?\s+(\d+(?:\s*(?:[-–,]|and|to)\s*\d+)*)", re.IGNORECASE)
HEADING = re.compile(r"^#{2,4}\s+Rule\s+(\d+)\b", re.MULTILINE)
BACKTICKED = re.compile(r"`([^`\n]+)`")


def cited_rules(text: str) -> set[int]:
    """The rule numbers a text cites: ranges expanded, lists split."""
    numbers = set()
    for match in CITATION.finditer(text):
        parts = re.split(r"\s*(,|and)\s*", match.group(1))
        for part in parts[::2]:
            bounds = [int(n) for n in re.split(r"\s*(?:[-–]|to)\s*", part)]
            numbers.update(range(bounds[0], bounds[-1] + 1))
    return numbers


def citations() -> dict[int, list[str]]:
    """Rule number -> the files (relative paths) that cite it."""
    out: dict[int, list[str]] = {}
    for folder in CITING:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():  # this file's examples cite nothing
                continue
            for n in cited_rules(path.read_text()):
                out.setdefault(n, []).append(path.relative_to(ROOT).as_posix())
    return out


def doc_text() -> str:
    return DOC.read_text()


def test_the_citation_reader_reads_ranges_and_lists():
    assert cited_rules("design rule 4; (rule 7)") == {4, 7}
    assert cited_rules("design rules 2-8") == set(range(2, 9))
    assert cited_rules("rules 2–3 and 9, and the rule every scorer shares") == {2, 3, 9}
    assert cited_rules("the rules, then 5 pages") == set()


def test_every_rule_the_code_cites_has_its_heading():
    headings = [int(n) for n in HEADING.findall(doc_text())]
    assert len(headings) == len(set(headings)), f"rule headings repeat a number: {headings}"
    cited = citations()
    assert cited, "no design rule citations found: the citation pattern no longer matches the code"
    missing = {n: files for n, files in cited.items() if n not in headings}
    assert not missing, f"docs/ARCHITECTURE.md has no `Rule N` heading for rules cited in {missing}"


def test_rule_headings_are_numbered_one_by_one_and_say_why():
    text = doc_text()
    headings = [int(n) for n in HEADING.findall(text)]
    assert headings == list(range(1, len(headings) + 1)), f"rule headings out of order: {headings}"
    sections = HEADING.split(text)[1:]  # number, body, number, body, ...
    for number, body in zip(sections[::2], sections[1::2]):
        body = re.split(r"^#{1,4}\s", body, flags=re.MULTILINE)[0]
        assert "Why:" in body, f"rule {number} states what but not why"


def looks_like_path(token: str) -> bool:
    if " " in token or "://" in token or token.startswith("/") or not re.fullmatch(r"[\w.\-/]+", token):
        return False
    return "/" in token or token.endswith(ROOT_FILE_SUFFIXES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    paths = sorted({t for t in BACKTICKED.findall(page.read_text()) if looks_like_path(t)})
    assert len(paths) > (20 if page == DOC else 5), f"too few paths found to trust the reader: {paths}"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/{page.name} names paths that do not exist: {missing}"


def test_the_readme_points_to_the_design():
    assert "docs/ARCHITECTURE.md" in (ROOT / "README.md").read_text()


# "`GenerateRequest` (`cairn/workers/request.py`", "`EngineSpec`** (`...`", "`RequestOutput`s (`...`"
TYPE_AT = re.compile(r"`(?P<name>[A-Z][A-Za-z0-9]+)`(?:\*\*|s)?\s*\(`(?P<path>[\w./]+\.py)`")


def defined_names(path: Path) -> set[str]:
    """The classes and module-level names a file defines."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_type_reader_finds_a_type_and_its_module_across_a_line_break():
    found = [m.groups() for m in TYPE_AT.finditer("one `GenerateRequest`\n   (`cairn/workers/request.py`) and "
                                                  "**`EngineSpec`** (`cairn/workers/spec.py`: ...), `Foo` alone")]
    assert found == [("GenerateRequest", "cairn/workers/request.py"), ("EngineSpec", "cairn/workers/spec.py")]


def test_every_type_a_page_places_in_a_module_is_defined_there():
    placed = {page.name: [(m["name"], m["path"]) for m in TYPE_AT.finditer(page.read_text())] for page in PAGES}
    assert len(placed[DOC.name]) > 10, f"too few types found in the map to trust the reader: {placed[DOC.name]}"
    assert sum(map(len, placed.values())) > 30, f"too few types found to trust the reader: {placed}"
    wrong = {page: [(name, path) for name, path in types
                    if (ROOT / path).exists() and name not in defined_names(ROOT / path)]
             for page, types in placed.items()}
    wrong = {page: types for page, types in wrong.items() if types}
    assert not wrong, f"pages place types in modules that do not define them: {wrong}"


def test_the_map_is_read_in_one_sitting_and_names_every_area_page():
    text = doc_text()
    lines = len(text.splitlines())
    assert lines <= MAP_MAX_LINES, f"docs/ARCHITECTURE.md has {lines} lines: move detail to an area page"
    for name in (*AREA_PAGES, "operations.md", "serving.md"):
        assert f"]({name})" in text, f"the map does not link docs/{name}"
    for name in AREA_PAGES:
        assert "](ARCHITECTURE.md" in (DOCS / name).read_text(), f"docs/{name} does not link back to the map"


LINK = re.compile(r"\]\((?P<file>[\w.\-/]*?\.md)?(?:#(?P<anchor>[\w\-]+))?\)")  # a link to a page, a heading or both
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces made
    hyphens, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", FENCED.sub("", text), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_anchor_reader_slugs_as_github_does():
    assert anchors("## 5. Design rules\n### Rule 1 — One page hash\n## Triton: tuning, warm-up\n## Not built\n"
                   "```bash\n# a comment, not a heading\n```\n## Not built\n") == {
        "5-design-rules", "rule-1--one-page-hash", "triton-tuning-warm-up", "not-built", "not-built-1"}
    found = [m.group("file", "anchor") for m in LINK.finditer("[a](cache.md) [b](#rules) [c](../README.md#on-a-gpu) "
                                                             "[d](https://example.com/x)")]
    assert found == [("cache.md", None), (None, "rules"), ("../README.md", "on-a-gpu")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_between_the_pages_reaches_its_heading(page):
    links = [m for m in LINK.finditer(page.read_text()) if m["file"] or m["anchor"]]
    assert links, f"no links found in docs/{page.name} to trust the reader"
    broken = []
    for m in links:
        target = (page.parent / m["file"]).resolve() if m["file"] else page
        if not target.exists():
            broken.append(m.group())
        elif m["anchor"] and m["anchor"] not in anchors(target.read_text()):
            broken.append(m.group())
    assert not broken, f"docs/{page.name} links to files or headings that do not exist: {broken}"
