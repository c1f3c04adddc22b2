"""BitTrain Table 1 reproduced: memory of ResNet conv activations, dense vs bitmap, fp32.

For each activation shape of the paper's Table 1 (batch 16) at 0/25/50/75/100 % non-zeros:

- theoretical MB (MB = 2**20 bytes) from the packed tensor's exact ``.nbytes`` (the paper's
  M_d = 4 n and M_b = 4 nnz + n / 8), and the improvement 1 - M_b / M_d;
- measured MB: in a fresh process per cell (``edgetorch.measure.tensor_worker``), the growth of
  the process's anonymous memory (the tensor part of USS) while it holds the dense tensor, and
  while it holds only the packed form after the dense tensor was deleted; the improvement;
- the paper's Theoretical and On-board (Jetson Nano, USS) columns next to ours.

Writes docs/results/table1_bitmap_memory.{json,md} and prints the table.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal


from _common import table, write_results

from edgetorch.measure import run_fresh
from edgetorch.measure.process import HONEST_MALLOC_ENV

MB = 2**20
NONZERO_PERCENT = (0, 25, 50, 75, 100)
_MMAP_THRESHOLD_KIB = int(HONEST_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]) // 1024

# Hosny et al., BitTrain (SEC'21), Table 1, typed in from the paper. Per shape and % non-zeros:
# (dense theoretical, dense on-board, bitmap theoretical, improvement theoretical %,
#  bitmap on-board, improvement on-board %), MB.
PAPER = {
    (16, 3, 224, 224): [
        (9.19, 10.53, 0.29, 96.88, 2.50, 76.26),
        (9.19, 10.77, 2.58, 71.88, 5.14, 52.27),
        (9.19, 10.83, 4.88, 46.88, 7.47, 31.02),
        (9.19, 10.87, 7.18, 21.88, 9.71, 10.67),
        (9.19, 10.76, 9.47, -3.13, 12.03, -11.80),
    ],
    (16, 7, 112, 112): [
        (5.36, 7.17, 0.17, 96.88, 2.67, 62.76),
        (5.36, 7.11, 1.51, 71.88, 4.07, 42.76),
        (5.36, 6.96, 2.85, 46.88, 5.19, 25.43),
        (5.36, 7.4, 4.19, 21.88, 6.97, 5.81),
        (5.36, 7.17, 5.53, -3.13, 8.11, -13.11),
    ],
    (16, 64, 56, 56): [
        (12.25, 13.95, 0.38, 96.88, 3.03, 78.28),
        (12.25, 13.95, 3.45, 71.88, 6.1, 56.27),
        (12.25, 13.86, 6.51, 46.88, 9.12, 34.20),
        (12.25, 13.48, 9.57, 21.88, 11.77, 12.69),
        (12.25, 13.85, 12.63, -3.13, 15.24, -10.04),
    ],
    (16, 128, 28, 28): [
        (6.13, 7.41, 0.19, 96.88, 2.10, 71.66),
        (6.13, 7.64, 1.72, 71.88, 4.02, 47.38),
        (6.13, 7.38, 3.25, 46.88, 5.31, 28.05),
        (6.13, 7.65, 4.79, 21.88, 6.91, 9.67),
        (6.13, 7.92, 6.32, -3.13, 8.83, -11.49),
    ],
    (16, 256, 14, 14): [
        (3.06, 4.80, 0.10, 96.88, 2.36, 50.83),
        (3.06, 4.61, 0.86, 71.88, 3.16, 31.45),
        (3.06, 4.99, 1.63, 46.88, 4.39, 12.02),
        (3.06, 4.95, 2.39, 21.88, 5.11, -3.23),
        (3.06, 4.33, 3.16, -3.13, 5.24, -21.02),
    ],
    (16, 512, 7, 7): [
        (1.53, 3.55, 0.05, 96.88, 2.47, 30.42),
        (1.53, 3.26, 0.43, 71.88, 3.02, 7.36),
        (1.53, 3.52, 0.81, 46.88, 3.55, -0.85),
        (1.53, 3.51, 1.20, 21.88, 4.08, -16.24),
        (1.53, 3.24, 1.58, -3.13, 4.16, -28.40),
    ],
}
PAPER_KEYS = ("dense_theory", "dense_onboard", "bitmap_theory", "improv_theory", "bitmap_onboard",
              "improv_onboard")


def cell(shape: tuple[int, ...], nonzero_percent: int) -> dict:
    """One row: our theoretical and measured MB for a shape and % non-zeros, and the paper's.

    Args:
        shape: activation shape from Table 1.
        nonzero_percent: share of non-zero elements, in percent.

    Returns:
        The row; measured values come from a fresh worker process.
    """
    measured = run_fresh(
        "edgetorch.measure.tensor_worker",
        {"shape": list(shape), "nonzero_fraction": nonzero_percent / 100, "seed": 0},
        timeout=300,
    )
    n = math.prod(shape)
    dense_theory = 4 * n / MB
    bitmap_theory = measured["packed_nbytes"] / MB
    kind = next(k for k in ("anon", "uss", "rss") if measured[f"dense_{k}"] >= 0)
    dense_measured = measured[f"dense_{kind}"] / MB
    bitmap_measured = measured[f"packed_{kind}"] / MB
    paper = dict(zip(PAPER_KEYS, PAPER[shape][NONZERO_PERCENT.index(nonzero_percent)]))
    return {
        "shape": list(shape),
        "elements": n,
        "nonzero_percent": nonzero_percent,
        "nnz": measured["nnz"],
        "ours": {
            "dense_theory_mb": dense_theory,
            "bitmap_theory_mb": bitmap_theory,
            "improv_theory_pct": 100 * (1 - bitmap_theory / dense_theory),
            "measure": kind,
            "dense_measured_mb": dense_measured,
            "bitmap_measured_mb": bitmap_measured,
            "improv_measured_pct": 100 * (1 - bitmap_measured / dense_measured),
            "pack_peak_rss_mb": measured["pack_peak_rss"] / MB,
            "raw_bytes": measured,
        },
        "paper": paper,
    }


def _r2(x: float) -> str:
    """Two decimals with halves away from zero, as the paper prints them (6.125 -> 6.13)."""
    return str(Decimal(repr(x)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table (the machine line is added by ``write_results``)."""
    lines = [
        "MB = 2^20 bytes. *Theory*: exact tensor bytes (ours: the packed tensor's `.nbytes`). "
        "*Measured*: growth of the process's anonymous memory while holding the dense tensor, and "
        "while holding only the packed form after the dense one was deleted. That is the part of "
        "the paper's USS (unique set size) that tensors live in; total USS also moves when the "
        "kernel drops clean library pages under memory pressure, so USS and RSS deltas are kept "
        "in the JSON as a cross-check. One fresh process per row, glibc's mmap threshold pinned so that freed "
        f"tensors leave the process. Blocks under that threshold ({_MMAP_THRESHOLD_KIB} KiB) come "
        "from the heap, which grows and shrinks in larger steps, so a small packed form (the "
        "49 KiB bitmap of 16x512x7x7 at 0%) can read above or below its size. *Paper*: Table 1 of BitTrain (on-board = "
        "Jetson Nano). Theory and measurement are different quantities; both are shown. Rounded "
        "like the paper (halves up).",
        "",
    ]
    cells = []
    for row in rows:
        o, p = row["ours"], row["paper"]
        mb = [o["dense_theory_mb"], p["dense_theory"], o["dense_measured_mb"], p["dense_onboard"],
              o["bitmap_theory_mb"], p["bitmap_theory"], o["bitmap_measured_mb"], p["bitmap_onboard"]]
        pcts = [o["improv_theory_pct"], p["improv_theory"], o["improv_measured_pct"], p["improv_onboard"]]
        cells.append(["x".join(map(str, row["shape"])), f"{row['nonzero_percent']}%", *map(_r2, mb),
                      *(_r2(c) + "%" for c in pcts)])
    headers = ["shape", "non-zeros", "dense theory", "paper", "dense measured", "paper on-board", "bitmap theory",
               "paper", "bitmap measured", "paper on-board", "improv. theory", "paper", "improv. measured",
               "paper on-board"]
    return "\n".join(lines) + "\n" + table(headers, cells, right=range(1, 14)) + "\n"


def main() -> None:
    """Measure every cell, write JSON and markdown under docs/results, print the table."""
    rows = []
    for shape in PAPER:
        for pct in NONZERO_PERCENT:
            rows.append(cell(shape, pct))
            o = rows[-1]["ours"]
            print(
                f"{'x'.join(map(str, shape)):>16} {pct:3d}%: "
                f"dense {o['dense_measured_mb']:.2f} MB, "
                f"bitmap {o['bitmap_measured_mb']:.2f} MB ({o['improv_measured_pct']:.1f}%)",
                flush=True,
            )
    write_results(
        "table1_bitmap_memory",
        "BitTrain Table 1: bitmap vs dense memory of ResNet conv activations (fp32, batch 16)",
        markdown(rows),
        {"rows": rows},
    )

if __name__ == "__main__":
    main()
