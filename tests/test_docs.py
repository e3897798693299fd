"""The README is the front door and docs/ the rest: small, every link inside the repository and alive."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick
ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target): the target up to a space or the closing parenthesis.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_stays_under_15_kb() -> None:
    assert (ROOT / "README.md").stat().st_size <= 15_000


# A measured figure: a number with the unit of a ratio, a time, a share or a rate.
FIGURE = re.compile(r"\d+(?:[.,]\d+)?\s?(?:×|x\b|ms\b|µs\b|s\b|%|calls/s)")


def test_the_readme_copies_no_measured_figure() -> None:
    """The benchmarks write their figures into docs/ themselves; one copied into the README by hand is stale
    after the next run (1.35x stood there for weeks after the run gave 1.02x). The README links to them."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert FIGURE.findall(text) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_in_the_repository_and_names_a_file_that_exists(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold commands, not links
    broken = []
    for target in LINK.findall(text):
        if target.startswith("#"):
            continue
        assert not re.match(r"[a-z]+:", target), f"{page.name} links outside the repository: {target}"
        resolved = (page.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    assert broken == []


def test_the_contract_page_is_the_shared_contract() -> None:
    """docs/contract.md is a copy of the project's wire contract, which the kit's own CI lays beside the
    checkout (../shared/CONTRACT.md); a clone on its own has only the copy, and nothing to compare."""
    shared = ROOT.parent / "shared" / "CONTRACT.md"
    if not shared.exists():
        pytest.skip("docs/contract.md is compared with the project's shared CONTRACT.md only in the kit's own CI")
    assert (ROOT / "docs" / "contract.md").read_text() == shared.read_text()


def layout() -> list[str]:
    """The paths architecture.md's Layout block names, each nested entry joined to its parent folder's."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("## Layout") :].split("```")[1]
    paths: list[str] = []
    parents: dict[int, str] = {}
    for line in block.strip("\n").splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0].rstrip(",")
        path = parents.get(depth - 1, "") + name if depth else name
        if name.endswith("/"):
            parents[depth] = path
        paths.append(path)
    return paths


def test_the_architecture_layout_is_the_tree() -> None:
    """Every path the layout names exists, and every module of the layer is named: the page cannot keep a
    file that moved, or miss one that came."""
    named = layout()
    assert [path for path in named if not (ROOT / path).exists()] == []
    modules = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "mcp_ha").rglob("*")
        if path.suffix in (".py", ".mjs") and "__pycache__" not in path.parts and path.name != "__init__.py"
    }
    assert sorted(modules - set(named)) == []
