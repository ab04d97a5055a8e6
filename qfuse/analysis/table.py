"""The plain-text table every analysis result prints (``str(summary)``, ``str(report)``,
``str(plan)``): columns as wide as their widest cell, two spaces apart, a dashed rule under the
header, no trailing spaces."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def text_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()
) -> str:
    """``rows`` of string cells under ``header``; the columns whose index is in ``right`` (numbers)
    are right-aligned, the rest left-aligned.

    Example:
        >>> print(text_table(["layer", "SQNR dB"], [["fc1", "31.20"], ["head", "8.05"]], right={1}))
        layer  SQNR dB
        -----  -------
        fc1      31.20
        head      8.05
    """
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
