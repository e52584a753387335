"""docs/structure.md names every room of the package: each folder (kernels/moe/ too) and each
top-level module, so the map cannot fall behind a move."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rooms(package: Path) -> list[str]:
    """`folder/` for each folder holding Python files (relative, nested ones whole), `name.py`
    for each top-level module."""
    folders = {
        p.parent.relative_to(package).as_posix() + "/"
        for p in package.rglob("*.py")
        if p.parent != package
    }
    return sorted(folders) + sorted(p.name for p in package.glob("*.py"))


def test_structure_md_names_every_room():
    text = (ROOT / "docs" / "structure.md").read_text()
    missing = [
        room
        for room in rooms(ROOT / "moelora")
        if f"`{room}`" not in text and f"`{room.rsplit('/', 2)[-2]}/`" not in text
    ]
    assert missing == []
