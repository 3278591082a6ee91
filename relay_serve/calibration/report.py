"""A calibration run's report: JSON with every candidate's statistics and a PNG chart of mean margin
per cue with its interval against the overall mean, selected cues marked."""

from __future__ import annotations

import json
from pathlib import Path

from relay_serve.calibration.cues import CueSet


def write_report(cue_set: CueSet, out_dir: Path, paper_selected: list[str], times: dict) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "cue_set": json.loads(cue_set.model_dump_json()),
        "paper_rule_selected": paper_selected,
        "stage_times_s": times,
    }
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    png_path = out_dir / "margins.png"
    plot_margins(cue_set, png_path)
    return json_path, png_path


def plot_margins(cue_set: CueSet, path: Path) -> None:
    from relay_serve.extras import pyplot

    plt = pyplot()

    rows = sorted((s for s in cue_set.candidates if s.count > 0 and s.mean is not None), key=lambda s: s.mean)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.35 * len(rows) + 1.2)))
    for i, s in enumerate(rows):
        chosen = s.cue in cue_set.selected
        color = "tab:green" if chosen else "tab:gray"
        lo = s.ci_low if s.ci_low is not None else s.mean
        hi = s.ci_high if s.ci_high is not None else s.mean
        ax.errorbar(s.mean, i, xerr=[[s.mean - lo], [hi - s.mean]], fmt="o", color=color, capsize=3)
        ax.text(hi + 0.004, i, f"n={s.count}", va="center", fontsize=8, color=color)
    ax.axvline(cue_set.overall_mean, color="tab:red", linestyle="--", label=f"overall mean {cue_set.overall_mean:.3f}")
    ax.set_yticks(range(len(rows)), [repr(s.cue) + (" *" if s.cue in cue_set.selected else "") for s in rows])
    ax.set_xlabel("small-model margin p(top1) - p(top2) after the cue, to the sentence end")
    rule = cue_set.rule
    ax.set_title(
        f"cue set {cue_set.version}: * selected ({rule.rule}, {int(rule.confidence * 100)}% interval, n >= "
        f"{rule.min_occurrences})",
        fontsize=9,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
