"""PNG plots of ``lime_megatron.analysis.measures`` results: models side by side where the paper compares
them (entropy and probe accuracy per layer: Fig. 2, 4a, 7; t-SNE: Fig. 3, 8), router figures per
LIMe model (Fig. 5 and App. Fig. 9, per-layer router heatmaps, self-retrieval and expected depth).
"""

from __future__ import annotations

import math
import os

import numpy as np

from lime_megatron.extras import requires_extra


def _pyplot():
    with requires_extra("plots"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def write_all(results: dict, embeddings: dict, out_dir: str) -> list[str]:
    """Every plot of ``results`` (``analysis.analyze``'s numbers) into ``out_dir``; their paths."""
    written = []
    models = results["models"]
    for kind in ("values", "hidden"):
        written.append(
            per_layer(
                models,
                f"entropy_{kind}",
                f"matrix Rényi entropy (alpha={results['alpha']})",
                f"{kind}: matrix entropy per layer",
                os.path.join(out_dir, f"entropy_{kind}.png"),
            )
        )
        if any(f"probe_{kind}" in numbers for numbers in models.values()):
            written.append(
                per_layer(
                    models,
                    f"probe_{kind}",
                    "probe accuracy (5-fold CV)",
                    f"{kind}: linear separability of {', '.join(results['words'])}",
                    os.path.join(out_dir, f"probe_{kind}.png"),
                )
            )
            written.append(tsne(embeddings, kind, list(results["words"]), os.path.join(out_dir, f"tsne_{kind}.png")))
    for name, numbers in models.items():
        if "router" in numbers:
            written.append(retrieval(name, numbers["router"], os.path.join(out_dir, f"retrieval_{name}.png")))
            written.append(router_heatmaps(name, numbers["router"], os.path.join(out_dir, f"routers_{name}.png")))
    return written


def per_layer(models: dict, key: str, ylabel: str, title: str, path: str) -> str:
    """One line per model (mean with a std band) over layers."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, numbers in models.items():
        if key not in numbers:
            continue
        mean, std = np.array(numbers[key]["mean"]), np.array(numbers[key]["std"])
        layers = np.arange(1, len(mean) + 1)
        axis.plot(layers, mean, "o-", label=name, markersize=3)
        axis.fill_between(layers, mean - std, mean + std, alpha=0.2)
    axis.set(xlabel="layer", ylabel=ylabel, title=title)
    axis.legend()
    return _save(plt, figure, path)


def tsne(embeddings: dict, kind: str, words: list[str], path: str) -> str:
    """Grid: one row per model, one column per chosen layer, points coloured by word."""
    plt = _pyplot()
    names = list(embeddings)
    layers = sorted({layer for name in names for (k, layer) in embeddings[name] if k == kind})
    figure, axes = plt.subplots(len(names), len(layers), figsize=(3 * len(layers), 3 * len(names)), squeeze=False)
    for row, name in enumerate(names):
        for col, layer in enumerate(layers):
            axis = axes[row][col]
            points, labels = embeddings[name][(kind, layer)]
            for label, word in enumerate(words):
                chosen = labels == label
                axis.scatter(points[chosen, 0], points[chosen, 1], s=4, label=word)
            axis.set_title(f"{name}, layer {layer + 1}", fontsize=9)
            axis.set_xticks([])
            axis.set_yticks([])
    axes[0][0].legend(fontsize=7, markerscale=2)
    figure.suptitle(f"t-SNE of {kind}")
    return _save(plt, figure, path)


def retrieval(name: str, router: dict, path: str) -> str:
    """Fig. 5 (normalised mean |router weight| of buffered layer j in layer l), the self-retrieval
    share and the expected retrieved depth per layer."""
    plt = _pyplot()
    shares = np.array(router["shares"])
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    masked = np.ma.masked_where(np.triu(np.ones_like(shares), 1) > 0, shares)
    edge = len(shares) + 0.5  # 1-based layer numbers on both axes
    image = axes[0].imshow(masked, cmap="viridis", origin="upper", extent=(0.5, edge, edge, 0.5))
    axes[0].set(xlabel="buffered layer j", ylabel="layer l", title=f"{name}: mean |R| share of layer j in layer l")
    figure.colorbar(image, ax=axes[0])
    layers = np.arange(1, len(shares) + 1)
    axes[1].plot(layers, router["self_retrieval"], "o-", markersize=3)
    axes[1].set(xlabel="layer", ylabel="share of own keys/values", title="self-retrieval")
    axes[2].plot(layers, np.array(router["expected_depth"]) + 1, "o-", markersize=3, label="expected retrieved layer")
    axes[2].plot(layers, layers, "--", color="grey", label="own layer")
    axes[2].set(xlabel="layer", ylabel="layer", title="expected retrieved depth")
    axes[2].legend()
    return _save(plt, figure, path)


def router_heatmaps(name: str, router: dict, path: str) -> str:
    """One heatmap per layer: rows = output heads, columns = (source layer, input head)."""
    plt = _pyplot()
    layers = sorted(router["weights"], key=int)
    cols = min(8, len(layers))
    rows = math.ceil(len(layers) / cols)
    figure, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.2 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, layer in zip(axes.flat, layers):
        weight = np.array(router["weights"][layer]["weight"])
        kv = weight.shape[0]
        bound = max(1e-12, np.abs(weight).max())
        axis.imshow(weight.reshape(kv, -1), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        axis.set_title(f"layer {int(layer) + 1}", fontsize=8)
        axis.axis("on")
        axis.set_xticks([])
        axis.set_yticks([])
    figure.suptitle(f"{name}: router weights (rows: heads; columns: source layer x head)")
    return _save(plt, figure, path)


def _save(plt, figure, path: str) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
