"""Text tables and byte counts, the one formatter every printout uses (plan, audit, memory)."""

from collections.abc import Sequence


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps a leading digit (`17.25 MiB`, `4 B`)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[object]], *, numeric: bool = False
) -> str:
    """A header, a rule and the rows, columns padded to their widest cell.

    `numeric=True` right-aligns every column but the first (tables of numbers); otherwise
    every column is left-aligned. Trailing spaces are stripped.
    """
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if numeric and i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])
