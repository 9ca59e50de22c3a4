"""The throughput experiment's summary: medians over repetitions, ratios to the seed, as a
markdown table and a bar chart."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.instruments import PLOT_DPI, median, new_figure
from benchmarks.ours_recipe import CONFIGS, SAME_LOADER_AS_OURS, SAME_SYNTHETIC_AS_OURS


def summarise(measurements: list[dict[str, Any]], train_images: int) -> list[dict[str, Any]]:
    """One row per configuration, world size and input: medians over the repetitions that did not fail."""
    ok = [m for m in measurements if "error" not in m]
    keys = list(dict.fromkeys((m["config"], m["world_size"], m["input"]) for m in measurements))

    def of(config: str, ws: int, kind: str) -> list[dict[str, Any]]:
        return [m for m in ok if (m["config"], m["world_size"], m["input"]) == (config, ws, kind)]

    rows = []
    for config, ws, kind in keys:
        runs = of(config, ws, kind)
        rates = [m["images_per_sec"] for m in runs]
        row: dict[str, Any] = {"config": config, "world_size": ws, "input": kind, "repeats": len(runs),
                               "failed": sum(1 for m in measurements if "error" in m and
                                             (m["config"], m["world_size"], m["input"]) == (config, ws, kind))}
        if runs:
            rate = median(rates)
            seed_runs = {m["repeat"]: m["images_per_sec"] for m in of("seed", ws, kind)}
            row.update(
                images_per_sec=round(rate, 2),
                images_per_sec_all=[round(r, 2) for r in rates],
                median_step_seconds=round(median(m["median_step_seconds"] for m in runs), 4),
                epoch_seconds_extrapolated=round(train_images / rate + median(m["first_batch_seconds"] for m in runs),
                                                 1),
                first_batch_seconds=round(median(m["first_batch_seconds"] for m in runs), 2),
                steps_timed=runs[0]["steps_timed"],
                first_step_seconds=round(median(m["first_step_seconds"] for m in runs), 2),
                warmup_excess_seconds=round(median(m["warmup_excess_seconds"] for m in runs), 2),
                setup_seconds=round(median(m["setup_seconds"] for m in runs), 2),
            )
            for key in ("peak_pss_mb", "steady_peak_pss_mb", "device_peak_mb"):
                values = [m[key] for m in runs if m.get(key) is not None]
                if values:
                    row[key] = round(median(values), 1)
            if kind == "real":
                row["loader_images_per_sec"] = round(median(m["loader_images_per_sec"] for m in runs), 2)
            if seed_runs and config != "seed":
                row["vs_seed"] = round(rate / median(seed_runs.values()), 3)
                paired = [m["images_per_sec"] / seed_runs[m["repeat"]] for m in runs if m["repeat"] in seed_runs]
                row["vs_seed_paired"] = round(median(paired), 3) if paired else None
        rows.append(row)
    return rows


def _group_order(group: tuple[str, int]) -> tuple[int, int]:
    config, ws = group
    return ws, CONFIGS.index(config)


def throughput_table(result: dict[str, Any]) -> str:
    """The summary as a markdown table: one row per configuration and world size; ratios are
    to the seed at the same world size and input."""
    rows = {(r["config"], r["world_size"], r["input"]): r for r in result["summary"]}
    header = ("| config | processes | synthetic img/s (vs seed) | real img/s (vs seed) | loader alone img/s | "
              "epoch s (extrapolated) | peak memory MiB (real) | compile s |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]

    def rate(row: dict[str, Any]) -> str:
        if "images_per_sec" not in row:
            return "–"
        ratio = 1.0 if row["config"] == "seed" else row.get("vs_seed")
        return f"{row['images_per_sec']:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

    def fmt(value: float | None, spec: str = ".1f") -> str:
        return "–" if value is None else f"{value:{spec}}"

    for config, ws in sorted(dict.fromkeys((c, w) for c, w, _ in rows), key=_group_order):
        syn = rows.get((config, ws, "synthetic")) or (rows.get(("ours", ws, "synthetic"))
                                                      if config in SAME_SYNTHETIC_AS_OURS else None) or {}
        real = rows.get((config, ws, "real"), {})
        loader = real.get("loader_images_per_sec")
        if loader is None and config in SAME_LOADER_AS_OURS:
            loader = rows.get(("ours", ws, "real"), {}).get("loader_images_per_sec")
        compile_s = real.get("warmup_excess_seconds", syn.get("warmup_excess_seconds")) if "compile" in config else None
        lines.append(
            f"| {config} | {ws} | {rate(syn)} | {rate(real)} | {fmt(loader)} | "
            f"{fmt(real.get('epoch_seconds_extrapolated'))} | {fmt(real.get('peak_pss_mb'), '.0f')} | "
            f"{fmt(compile_s, '.0f')} |"
        )
    return "\n".join(lines)


def plot_throughput(result: dict[str, Any], path: Path) -> None:
    """Training images/s per configuration and world size, synthetic next to real, with the
    loader alone as a tick: where the tick is below a real bar's top, data loading limits it."""
    rows = {(r["config"], r["world_size"], r["input"]): r for r in result["summary"] if "images_per_sec" in r}
    if not rows:
        print("no measurement succeeded: no plot")
        return
    groups = sorted(dict.fromkeys((c, w) for c, w, _ in rows), key=_group_order)
    fig = new_figure(max(6.5, 1.35 * len(groups) + 2), 4.8)
    if fig is None:
        return
    ax = fig.subplots()
    width = 0.38
    # A loader far faster than training (tiny images, the cache) would flatten the bars: clip its tick.
    top = 1.3 * max(r["images_per_sec"] for r in rows.values())
    for i, (config, ws) in enumerate(groups):
        for offset, kind, style in ((-width / 2, "synthetic", {"color": "#9ecae1", "hatch": "//"}),
                                    (width / 2, "real", {"color": "#3182bd"})):
            row = rows.get((config, ws, kind))
            if row is None:
                continue
            ax.bar(i + offset, row["images_per_sec"], width, edgecolor="black", linewidth=0.5, **style,
                   label=f"{kind} input" if i == 0 else None)
            label = f"{row['images_per_sec']:.1f}"
            if kind == "real" and "vs_seed" in row:
                label += f"\n{row['vs_seed']:.2f}x"
            ax.annotate(label, (i + offset, row["images_per_sec"]), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
            if kind == "real" and "loader_images_per_sec" in row:
                loader = row["loader_images_per_sec"]
                ax.plot([i + offset - width / 2, i + offset + width / 2], [min(loader, top)] * 2,
                        color="tab:red", linewidth=2, label="data loader alone" if i == 0 else None)
                if loader > top:
                    ax.annotate(f"loader {loader:.0f} ↑", (i + offset, top), ha="center", va="top", fontsize=7,
                                color="tab:red", xytext=(0, -3), textcoords="offset points")
    ax.set_xticks(range(len(groups)), [f"{c}\n{w} process{'es' if w > 1 else ''}"
                                       + ("\n(synthetic: as ours)" if c in SAME_SYNTHETIC_AS_OURS else "")
                                       for c, w in groups])
    ax.set_ylabel("training images/s (median)")
    settings = result["settings"]
    ax.set_title(f"{result['machine']['name']}\n{settings['img_size']} px, batch {settings['batch_size_per_process']} "
                 f"per process, median of {settings['repeats']}; ratios: real input vs seed with as many processes",
                 fontsize=9)
    ax.set_ylim(0, 1.08 * top)
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    fig.savefig(path, dpi=PLOT_DPI)
