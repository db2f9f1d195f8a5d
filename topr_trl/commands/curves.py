"""A picture of a run: the curves a trainer logged (its `state.log_history`), one panel per quantity, written next to
the model so that every command-line run leaves a look at itself (`topr-trl train` and `iterate` print its path)."""

from __future__ import annotations

import fnmatch
from pathlib import Path


# Panel title -> the logged keys drawn in it, in this order (a pattern with `*` draws every logged key it matches:
# TRL's per-function rewards, `rewards/<function>/mean`); a panel none of whose keys was logged is left out.
PANELS: dict[str, tuple[str, ...]] = {
    "reward (training batches)": ("reward", "rewards/*/mean"),
    "loss": ("loss",),
    "share of positives": ("topr/positive_fraction", "topr/effective_positive_proportion"),
    "pi/mu (mean)": ("topr/ratio_positive/mean", "topr/ratio_negative/mean"),
    "negatives' weight and truncation": ("topr/weight_negative/mean", "topr/negative_truncated_fraction"),
    "evaluation": ("eval_reward", "eval_loss"),
    "completion length (mean)": ("completions/mean_length",),
    "entropy": ("entropy",),
}


def logged_curves(log_history: list[dict], step_offset: int = 0) -> dict[str, tuple[list[int], list[float]]]:
    """Every key of `PANELS` that was logged, as (steps, values) in logging order; NaN (TRL's "not measured") and
    non-numbers are left out. `step_offset` shifts the steps (runs drawn one after another, as iterations)."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        for key in (key for key in entry if any(_matches(key, drawn) for drawn in _DRAWN)):
            value = entry[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                steps, values = curves.setdefault(key, ([], []))
                steps.append(int(entry.get("step", 0)) + step_offset)
                values.append(float(value))
    return curves


_DRAWN = tuple(key for keys in PANELS.values() for key in keys)


def _matches(key: str, drawn: str) -> bool:
    return fnmatch.fnmatchcase(key, drawn) if "*" in drawn else key == drawn


def drawn_panels(curves: dict) -> list[tuple[str, list[str]]]:
    """The panels `plot_curves` draws for `curves`: (title, the keys in it), those with no key left out."""
    panels = [
        (name, [key for drawn in keys for key in sorted(curves) if _matches(key, drawn)])
        for name, keys in PANELS.items()
    ]
    return [(name, keys) for name, keys in panels if keys]


def plot_curves(
    curves: dict[str, tuple[list[int], list[float]]], path: str | Path, title: str, boundaries: list[int] = ()
) -> Path | None:
    """Draw `curves` (from `logged_curves`) to the PNG `path`, one panel per `PANELS` entry that has data, dashed
    vertical lines at `boundaries` (where iterations start); None, and no file, when nothing was logged."""
    panels = drawn_panels(curves)
    if not panels:
        return None
    import matplotlib  # noqa: PLC0415 - matplotlib: 0.5 s to import, only to draw

    matplotlib.use("Agg")  # a file, never a window: runs are often on machines without a screen
    import matplotlib.pyplot as plt  # noqa: PLC0415 - matplotlib: 0.5 s to import, only to draw
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 - matplotlib: 0.5 s to import, only to draw

    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for axis, (name, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            steps, values = curves[key]
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        for boundary in boundaries:
            axis.axvline(boundary, color="grey", linestyle="--", linewidth=0.8)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole
        if len(keys) > 1:
            axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
