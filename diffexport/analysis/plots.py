"""PNG plots of the analysis results (matplotlib, the `plots` extra, imported only when asked)."""

from __future__ import annotations

import io
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.files import atomic_write


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise DiffExportError("plots need matplotlib: pip install 'diffexport[plots]'") from None
    matplotlib.use("Agg")  # files only, no display
    # Text in our plots comes from strangers' files (folder, output and model names): shown as it is,
    # never read as mathematics (`q$^^$x` and `$\\undefinedcmd$` made matplotlib raise).
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def _png_path(path) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise DiffExportError(f"plot path must end in .png, got {path}")
    return path


def figure_png(fig) -> bytes:
    """The figure as PNG bytes (for a page that inlines it), closed whatever happens."""
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
        return buffer.getvalue()
    finally:
        pyplot().close(fig)


def _save(fig, path) -> Path:
    """Write the figure (whole or not at all) and close it, whatever happens."""
    try:
        path = _png_path(path)
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
        return path
    finally:
        pyplot().close(fig)


def check_plot_path(path) -> None:
    """Fail before the work when the plot cannot be written."""
    if path is None:
        return
    path = _png_path(path)
    if not path.parent.is_dir():
        raise DiffExportError(f"plot folder does not exist: {path.parent}")
    pyplot()


def plot_stats(named, path) -> Path:
    """Per-layer top-1 and median attention-logit magnitude, one line per model (log scale)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    from matplotlib.ticker import MaxNLocator

    for index, ((name, stats), marker) in enumerate(zip(named.items(), "os^vD")):
        layers, color = range(len(stats.logits)), f"C{index}"
        axes[0].plot(layers, [t.rank(1) for t in stats.logits], marker=marker, color=color, label=f"{name} top-1")
        axes[0].plot(layers, [t.median() for t in stats.logits], marker=marker, color=color, linestyle="--",
                     label=f"{name} median")
        axes[1].plot(layers, [t.rank(1) for t in stats.hidden], marker=marker, color=color, label=f"{name} top-1")
    axes[0].set(title="attention logits |scale * q.k|", xlabel="layer", ylabel="magnitude", yscale="log")
    axes[1].set(title="hidden states |x| (after each layer)", xlabel="layer", yscale="log")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def kl_floor(values) -> float:
    """Where a KL of 0 (the 16-bit reference itself) is drawn on the log axis: a decade under the
    smallest positive value."""
    positive = [v for v in values if v > 0]
    return min(positive) / 10 if positive else 1e-12


def format_kl_axis(ax, floor: float) -> None:
    """Log scale with a labelled tick every decade (a symlog axis showed only 0 and 1e-6), the
    floor labelled as 0."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=15))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v <= floor * 1.0001 else f"{v:.0e}"))
    low, high = ax.get_ylim()
    ax.set_ylim(floor / 1.5, max(high, floor * 100))
    ax.axhline(floor, color="0.6", lw=0.8, ls=":")
    ax.set_ylabel("log scale; the dotted line is 0")


def plot_sweep(named, path, describe: str) -> Path:
    """Task accuracy (when known), KL divergence and logit cosine against bits, models side by side."""
    plt = pyplot()
    has_task = any(p.task_accuracy is not None for points in named.values() for p in points)
    panels = (["task_accuracy"] if has_task else []) + ["kl_mean", "cosine_mean"]
    titles = {"task_accuracy": "retrieval accuracy", "kl_mean": "KL(p16 || p_bits), mean per token",
              "cosine_mean": "output-logit cosine vs 16-bit"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, layout="constrained")
    for ax, key in zip(axes[0], panels):
        floor = kl_floor([p.kl_mean for points in named.values() for p in points]) if key == "kl_mean" else None
        for (name, points), marker in zip(named.items(), "os^vD"):
            shown = [p for p in points if getattr(p, key) is not None]
            values = [getattr(p, key) for p in shown]
            if floor is not None:
                values = [max(v, floor) for v in values]
            ax.plot([p.bits for p in shown], values, marker=marker, label=name)
        ax.set(title=titles[key], xlabel="logit bits")
        if floor is not None:
            format_kl_axis(ax, floor)
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"low-bit attention logits ({describe})", fontsize=10)
    return _save(fig, path)


def plot_linear_sweep(named, path) -> Path:
    """KL divergence (and task accuracy, when known) per quantisation scheme, models side by side."""
    plt = pyplot()
    has_task = any(p.task_accuracy is not None for points in named.values() for p in points)
    panels = (["task_accuracy"] if has_task else []) + ["kl_mean"]
    titles = {"task_accuracy": "retrieval accuracy", "kl_mean": "KL(p_float || p_quantised), mean per token"}
    schemes = list(dict.fromkeys(p.scheme for points in named.values() for p in points if p.scheme != "float"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.6), squeeze=False, layout="constrained")
    width = 0.8 / max(len(named), 1)
    for ax, key in zip(axes[0], panels):
        shown = schemes if key == "kl_mean" else ["float", *schemes]
        values_all = [getattr(p, key) for points in named.values() for p in points if p.scheme in shown]
        floor = kl_floor(values_all) if key == "kl_mean" else None
        for i, (name, points) in enumerate(named.items()):
            by_scheme = {p.scheme: getattr(p, key) for p in points}
            values = [by_scheme.get(s) or 0.0 for s in shown]
            if floor is not None:
                values = [max(v, floor) for v in values]
            ax.bar([x + i * width for x in range(len(shown))], values, width, label=name)
        ax.set_xticks([x + width * (len(named) - 1) / 2 for x in range(len(shown))], shown)
        ax.set(title=titles[key], xlabel="linear layers")
        if floor is not None:
            ax.set_yscale("log")
            ax.set_ylim(top=max(values_all + [floor]) * 4)  # room for the legend above the bars
        else:
            ax.set_ylim(0, max([v for v in values_all if v is not None] + [1e-9]) * 1.3)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle("quantised linear layers: damage against the float model", fontsize=10)
    return _save(fig, path)


def plot_retrieval(named, path) -> Path:
    """Heat maps: attention of the question over document position (last layer) per needle depth."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(named), figsize=(5.6 * len(named), 3.4), squeeze=False, layout="constrained")
    for ax, (name, result) in zip(axes[0], named.items()):
        depths = sorted(result.profiles)
        data = [result.profiles[d] for d in depths]
        image = ax.imshow(data, aspect="auto", cmap="viridis", extent=(0, 100, len(depths) - 0.5, -0.5))
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
        ax.set(title=f"{name}: accuracy {result.accuracy():.2f}", xlabel="document position (%)",
               ylabel="needle depth")
        fig.colorbar(image, ax=ax, label="attention (mean over heads)")
    fig.suptitle("where the question looks (last layer; the asked needle sits at the depth)", fontsize=10)
    return _save(fig, path)


def plot_decode_steps(comparisons, path, title: str) -> Path:
    """A KV-cache check, step by step (0 = prefill): the KL budget (quantised models) or the largest
    error against its bound (the dtype rule), and the logit cosine against its floor."""
    return _save(decode_steps_figure(comparisons, title), path)


def decode_steps_figure(comparisons, title: str):
    """plot_decode_steps' figure (the caller saves or inlines it)."""
    plt = pyplot()
    steps = list(range(len(comparisons)))
    quantised = hasattr(comparisons[0], "budget")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.6), layout="constrained")
    if quantised:
        values = [c.mean_kl if c.mean_kl is not None else float("nan") for c in comparisons]
        left.plot(steps, values, marker=".", label="mean KL(reference || model)")
        left.axhline(comparisons[0].budget.max_kl, color="C3", linestyle="--", label="budget")
        left.set(title="next-token KL per step (nats)")
        floor = comparisons[0].budget.min_cosine
    else:
        left.plot(steps, [c.max_abs for c in comparisons], marker=".", label="max |model - reference|")
        left.plot(steps, [c.bound for c in comparisons], color="C3", linestyle="--", label="bound")
        left.set(title="largest logit error per step")
        floor = comparisons[0].min_cosine
    left.set_yscale("log")
    right.plot(steps, [c.cosine for c in comparisons], marker=".", label="logit cosine")
    right.axhline(floor, color="C3", linestyle="--", label="floor")
    right.set(title="logit cosine per step")
    right.ticklabel_format(axis="y", useOffset=False)
    for ax in (left, right):
        ax.set(xlabel="step (0 = prefill)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


def sampling_plot_path(path) -> Path:
    """Where `check --sample --plot P.png` draws the sampled tokens: beside P, as P-sampling.png."""
    path = _png_path(path)
    return path.with_name(path.stem + "-sampling.png")


def plot_sampled_draws(rows, path, title: str, shown: int = 16) -> Path:
    """`check --sample`: per prompt, the eager probability of the `shown` likeliest candidates (bars)
    and the share of genai's draws on each (points, +-2 standard errors), then the draws outside the
    eager candidates. rows: (probabilities [V] float, draw counts [V] float, draws, outside) per prompt."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.4), layout="constrained", squeeze=False)
    for index, (ax, (probs, counts, draws, outside)) in enumerate(zip(axes[0], rows)):
        top = probs.argsort(descending=True)[:min(shown, int((probs > 0).sum()))]
        p, share = probs[top].tolist(), (counts[top] / draws).tolist()
        spread = [2 * (q * (1 - q) / draws) ** 0.5 for q in p]
        x = list(range(len(p)))
        ax.bar(x, p, color="C0", alpha=0.5, label="eager probability")
        low = [min(e, s) for e, s in zip(spread, share)]  # a share is never below 0
        ax.errorbar(x, share, yerr=[low, spread], fmt="o", color="C1", markersize=3, label="genai draws (+-2 s.e.)")
        ax.set_xticks(x, [str(int(t)) for t in top], rotation=90, fontsize=7)
        ax.set(title=f"prompt {index + 1}: {draws} draws, {outside} outside", xlabel="token id (likeliest first)",
               ylabel="probability")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
