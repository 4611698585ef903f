"""One plain-text table formatter, for the CLI, the benchmarks and anything printed."""

from __future__ import annotations


def format_table(rows: list[dict], columns: list[str], formats: dict[str, str] | None = None,
                 title: str | None = None) -> str:
    """rows of dicts -> aligned columns; formats maps a column to a format string ("{:.1f}")."""
    formats = formats or {}
    cells = [[formats.get(c, "{}").format(r[c]) if c in r else "" for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines += ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
