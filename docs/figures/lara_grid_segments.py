"""Draw LARA's 2-D segments (``grid=(H, W)``) on two image grids: docs/figures/*.png.

Run from the repository root: ``python docs/figures/lara_grid_segments.py``. It draws the
bins that ``xattn.lara`` uses as segments (those of 2-D adaptive average pooling, from
``xattn._estimators.segments.adaptive_bins``) and checks them against PyTorch's
``adaptive_avg_pool2d`` when torch is installed. Runs in about a second.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from xattn._estimators.segments import adaptive_bins, segment_means

OUT = Path(__file__).with_suffix(".png")
CASES = [((14, 14), (7, 7)), ((7, 9), (3, 4))]


def check_against_torch(grid, pools):
    try:
        import torch
    except ImportError:
        return
    (height, width), (pool_h, pool_w) = grid, pools
    x = np.random.default_rng(0).normal(size=(1, height * width, 3))
    ours, _ = segment_means(np, x, None, pool_h * pool_w, None, grid=grid, pools=pools)
    image = torch.tensor(x).reshape(1, height, width, 3).permute(0, 3, 1, 2)
    theirs = torch.nn.functional.adaptive_avg_pool2d(image, pools)
    theirs = theirs.permute(0, 2, 3, 1).reshape(1, pool_h * pool_w, 3).numpy()
    assert np.allclose(ours, theirs, rtol=0, atol=1e-12), (grid, pools)


def draw(axis, grid, pools):
    (height, width), (pool_h, pool_w) = grid, pools
    colors = plt.get_cmap("tab20")
    row_bins, column_bins = adaptive_bins(height, pool_h), adaptive_bins(width, pool_w)
    coverage = np.zeros((height, width), dtype=int)
    for i, (top, bottom) in enumerate(row_bins):
        for j, (left, right) in enumerate(column_bins):
            segment = i * pool_w + j
            coverage[top:bottom, left:right] += 1
            axis.add_patch(Rectangle((left, top), right - left, bottom - top,
                                     facecolor=colors(((i % 2) * 2 + j % 2) * 2 % 20),
                                     alpha=0.45, edgecolor="black", linewidth=1.6))
            axis.text((left + right) / 2, (top + bottom) / 2, str(segment), ha="center",
                      va="center", fontsize=7 if pool_h * pool_w > 20 else 9)
    for r in range(height + 1):
        axis.axhline(r, color="grey", linewidth=0.3)
    for c in range(width + 1):
        axis.axvline(c, color="grey", linewidth=0.3)
    shared = np.argwhere(coverage > 1)
    for r, c in shared:  # tokens in two or four bins (the bins overlap)
        axis.plot(c + 0.5, r + 0.5, marker="x", color="black", markersize=4)
    axis.set_xlim(0, width)
    axis.set_ylim(height, 0)
    axis.set_aspect("equal")
    axis.set_xticks([])
    axis.set_yticks([])
    title = (f"grid=({height}, {width}), num_samples=({pool_h}, {pool_w}): "
             f"C = {pool_h * pool_w}")
    if len(shared):
        title += "\n(x: token in more than one segment)"
    axis.set_title(title, fontsize=9)


def main():
    figure, axes = plt.subplots(1, len(CASES), figsize=(9, 4.2))
    for axis, (grid, pools) in zip(axes, CASES, strict=True):
        check_against_torch(grid, pools)
        draw(axis, grid, pools)
    figure.suptitle("LARA's 2-D segments: the bins of adaptive average pooling "
                    "(row-major token order)", fontsize=10)
    figure.tight_layout()
    figure.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
