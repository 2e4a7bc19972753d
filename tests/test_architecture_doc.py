"""docs/ARCHITECTURE.md stays true to the code it maps: every design rule the code cites has a
heading there with its number, and every path the document names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
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


def test_every_path_the_doc_names_exists():
    paths = sorted({t for t in BACKTICKED.findall(doc_text()) if looks_like_path(t)})
    assert len(paths) > 20, f"too few paths found to trust the reader: {paths}"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


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


def test_every_type_the_doc_places_in_a_module_is_defined_there():
    placed = [(m["name"], m["path"]) for m in TYPE_AT.finditer(doc_text())]
    assert len(placed) > 10, f"too few types found to trust the reader: {placed}"
    wrong = [(name, path) for name, path in placed
             if (ROOT / path).exists() and name not in defined_names(ROOT / path)]
    assert not wrong, f"docs/ARCHITECTURE.md places types in modules that do not define them: {wrong}"
