"""The tool repository's coverage picture, like K2's Figure 8: a 2-D PCA of tool-description embeddings.

    cov = plot_coverage(repo, "out/tool_coverage.png")   # {"points": [N, 2], "labels": [...], ...}

Each tool is embedded as `NAME words: description` with the offline MiniLM embedder
(`k2_data.embed`, unit vectors), projected to 2-D with scikit-learn's PCA (deterministic: no
t-SNE perplexity or seed to tune, and the axes mean the same across runs of one repository), and drawn
with matplotlib's Agg backend in two panels: coloured by source (mcp / json / synthetic) and by domain
(an MCP tool's server, a JSON file's stem, a synthetic tool's category).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k2_data.agentic.evolve import tool_text

SOURCE_COLOURS = {"mcp": "#1f77b4", "json": "#2ca02c", "synthetic": "#d62728"}


def source_kind(source: str) -> str:
    return source.split(":", 1)[0] if source.split(":", 1)[0] in SOURCE_COLOURS else "synthetic"


def domain_of(entry: Any) -> str:
    if entry.domain:
        return entry.domain.split("/", 1)[0]
    return entry.category or entry.source.split(":", 1)[-1]


def project_tools(entries: list[Any], embedder: Any = None) -> dict[str, Any]:
    """`{"points": [[x, y], ...] (one per tool), "labels": [{"name", "source", "domain"}], "explained_variance":
    [pc1, pc2]}` for repository entries."""
    import numpy as np
    from sklearn.decomposition import PCA

    if embedder is None:
        from k2_data.embed import load_embedder

        embedder = load_embedder()
    labels = [{"name": e.name, "source": source_kind(e.source), "domain": domain_of(e)} for e in entries]
    if not entries:
        return {"points": np.zeros((0, 2)), "labels": labels, "explained_variance": [0.0, 0.0]}
    x = embedder.embed([tool_text(e.spec) for e in entries]).numpy().astype("float64")
    k = min(2, len(entries), x.shape[1])
    points = np.zeros((len(entries), 2))
    variance = [0.0, 0.0]
    if len(entries) > 1:
        pca = PCA(n_components=k, svd_solver="full")
        points[:, :k] = pca.fit_transform(x)
        variance[:k] = [round(float(v), 4) for v in pca.explained_variance_ratio_]
    return {"points": points, "labels": labels, "explained_variance": variance}


def plot_coverage(
    repo: Any, path: str | Path, embedder: Any = None, title: str | None = None
) -> dict[str, Any]:
    """Write the PNG; returns the projection plus `path`, `tools`, `by_source`, `domains`."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # no pyplot: no global state, safe in threads

    entries = list(getattr(repo, "entries", repo))
    proj = project_tools(entries, embedder)
    pts, labels = proj["points"], proj["labels"]
    domains = sorted({lab["domain"] for lab in labels})
    cmap = matplotlib.colormaps["tab20"]
    dom_colour = {d: cmap(i % 20) for i, d in enumerate(domains)}

    fig = Figure(figsize=(13, 6), dpi=110)
    ax_s, ax_d = fig.subplots(1, 2)
    for kind, colour in SOURCE_COLOURS.items():
        idx = [i for i, lab in enumerate(labels) if lab["source"] == kind]
        if idx:
            ax_s.scatter(pts[idx, 0], pts[idx, 1], s=28, c=colour, label=f"{kind} ({len(idx)})", alpha=0.85)
    for d in domains:
        idx = [i for i, lab in enumerate(labels) if lab["domain"] == d]
        ax_d.scatter(
            pts[idx, 0], pts[idx, 1], s=28, color=dom_colour[d], label=f"{d} ({len(idx)})", alpha=0.85
        )
    if len(labels) <= 60:  # small repositories: name every point
        for (x, y), lab in zip(pts, labels):
            ax_d.annotate(
                lab["name"], (x, y), fontsize=6, alpha=0.7, xytext=(2, 2), textcoords="offset points"
            )
    ev = proj["explained_variance"]
    for ax, what in ((ax_s, "source"), (ax_d, "domain")):
        ax.set_xlabel(f"PC1 ({ev[0]:.0%} of variance)")
        ax.set_ylabel(f"PC2 ({ev[1]:.0%})")
        ax.set_title(f"tools by {what}")
        if labels:
            ax.legend(fontsize=7, loc="best", markerscale=0.8)
        ax.grid(alpha=0.2)
    fig.suptitle(
        title or f"Tool repository coverage: {len(labels)} tools, PCA of MiniLM description embeddings"
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    by_source: dict[str, int] = {}
    for lab in labels:
        by_source[lab["source"]] = by_source.get(lab["source"], 0) + 1
    return {**proj, "path": str(path), "tools": len(labels), "by_source": by_source, "domains": len(domains)}
