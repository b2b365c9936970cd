"""The docs are tested like code: the README stays short, every link and every file a document
names exists, and docs/configuration.md's table of options is the one EngineConfig makes."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.flags import options_table

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|sh|md|txt|json|jinja|cpp|yaml|toml))`")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to dashes."""
    found = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_readme_is_at_most_300_lines_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md: keep it to what pagedkv is, the two commands, " \
                                          "the API and server in brief and the feature table; details go to docs/"
    for command in ("bash scripts/run.sh", "bash scripts/test.sh"):
        assert command in text
        assert (ROOT / command.split()[1]).exists()


def test_every_relative_link_resolves_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "fix these links:\n" + "\n".join(broken)


def test_every_file_a_document_names_exists():
    """A path in backticks (`engine/scheduler.py`, `bench/tiers.py`) names a file of the repository,
    or of the package (paths inside pagedkv/ are often written without it). Tests may move between
    folders: a test file is found by its name anywhere under tests/."""
    tests = {p.name for p in (ROOT / "tests").rglob("*") if p.is_file()}
    missing = []
    for page in PAGES:
        for path in CODE_PATH.findall(page.read_text()):
            if path.startswith(("~", ".venv/", "shared/")) or "DIR/" in path:  # shared/: design notes, not in git
                continue
            if (ROOT / path).exists() or (ROOT / "pagedkv" / path).exists():
                continue
            if path.startswith("tests/") and Path(path).name in tests:
                continue
            missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "these documents name files that do not exist (moved? update the text):\n" + \
        "\n".join(missing)


def test_every_engine_option_is_documented_once_in_its_field():
    undocumented = [f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("help", "").strip()]
    assert not undocumented, f"EngineConfig fields without metadata['help']: {undocumented}"


def test_configuration_doc_holds_the_table_engine_config_makes():
    text = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = "<!-- options table: begin", "<!-- options table: end -->"
    table = text[text.index(begin):text.index(end)].split("\n", 1)[1]
    assert table == options_table(), ("docs/configuration.md is out of date: paste the output of "
                                      "`python -m pagedkv.engine.flags` between its options-table markers")


def _layering_table() -> tuple[dict[str, frozenset[str]], frozenset[str]]:
    """tests/test_layering.py's ALLOWED (unit -> the units it may import) and FACTS, read from the
    file wherever the tests folder keeps it."""
    path = next((ROOT / "tests").rglob("test_layering.py"))
    spec = importlib.util.spec_from_file_location("_layering_for_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {unit: allowed for unit, (allowed, _why) in module.ALLOWED.items()}, module.FACTS


def test_architecture_packages_table_is_the_layering_tests_table():
    """docs/architecture.md's package tables say what each unit may import; test_layering.py
    enforces its own copy of that table. They must say the same."""
    allowed, facts = _layering_table()
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Packages"):text.index("### Inside the memory core")]
    unit = re.compile(r"`([\w]+)(?:/|\.py)?`")
    documented: dict[str, frozenset[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, last = line.split("|")[1], line.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()
        imports = set(unit.findall(last)) | (facts if last.startswith("facts") else set())
        documented[unit.search(first).group(1)] = frozenset(imports)
    differ = {u: (sorted(documented.get(u, set())), sorted(a)) for u, a in allowed.items() if documented.get(u) != a}
    extra = sorted(set(documented) - set(allowed))
    assert not differ and not extra, (f"docs/architecture.md (documented, allowed) differ from test_layering.py's "
                                      f"ALLOWED: {differ}; rows the test does not know: {extra}")
