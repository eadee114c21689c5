"""The ownership plot of a harness run (`--plot PATH`): which rank wrote each position.

One request of one CP group, drawn as a rank-by-position grid with the virtual
block boundaries marked, so the interleave is visible. matplotlib is imported
only when a plot is drawn.
"""

from __future__ import annotations

import sys


def ownership_plot(results: list[dict], path: str) -> None:
    """PNG of which rank wrote each position of one request (the interleave, visible)."""
    candidates = [r for r in results if r["plot"]]
    if not candidates:
        print("cp-blocktables: --plot: no request to plot", file=sys.stderr)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    chosen = max(candidates, key=lambda r: (r["plot"]["cp_size"] > 1, r["plot"]["interleave"] > 1))
    p = chosen["plot"]
    c, bs, inter = p["cp_size"], p["block_size"], p["interleave"]
    span = min(max(pos for pos, _ in p["points"]) + 1, 4 * bs * c)
    grid = np.zeros((c, span))
    for pos, k in p["points"]:
        if pos < span:
            grid[k, pos] += 1
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * c))
    ax.imshow(
        grid,
        aspect="auto",
        cmap="Blues",
        vmin=0,
        vmax=max(1, grid.max()),
        interpolation="nearest",
    )
    for x in range(0, span, bs * c):
        ax.axvline(x - 0.5, color="red", linewidth=0.8)
    ax.set_yticks(range(c), [f"rank {k}" for k in range(c)])
    ax.set_xlabel("position (red lines: virtual block boundaries)")
    ax.set_title(
        f"{chosen['preset']}: request {p['request']}, group {p['group']}, "
        f"cp_size {c}, interleave {inter}, block size {bs}: rank that wrote each "
        f"position",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
