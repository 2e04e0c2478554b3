"""Markdown tables and matplotlib (Agg) plots for the training-quality runs: `acco-bench
convergence` (with its update-compute ratio table) and `acco-bench lr-sweep`. The speed benchmarks'
reports, and the helpers both use, are in report.py."""

from __future__ import annotations

from pathlib import Path

from acco_bench.report import COLORS, colors_for, fmt, md_table, pyplot, write_report


def convergence_markdown(conv: dict, plots: list[str]) -> str:
    cfg = conv["config"]
    lines = [f"# acco-bench convergence: {cfg.get('data_path') or cfg.get('data')}", ""]
    size = cfg.get("model_size") or "(the config's own size)"
    tok = cfg.get("tokenizer") or "the model config's (bpe: trained by the CLI on the corpus)"
    lines.append(
        f"Model `{cfg['model']}` {size}, {cfg['hosts']} workers ({cfg.get('network')}), "
        f"tokenizer {tok}, micro-batch {cfg['batch_size']} x {cfg['max_length']}, "
        f"{cfg['grad_accum']} micro-batches per worker per update (acco {cfg['grad_accum'] // 2} per round), "
        f"nb_steps_tot {cfg['nb_steps_tot']}, seeds {cfg['seeds']}, accumulate_while_waiting "
        f"{cfg['accumulate_while_waiting']}."
    )
    lines.append("")
    rows = []
    table = conv["final_eval_loss"]
    ref = table.get("ddp", {}).get("mean")
    for m, t in table.items():
        rel = (t["mean"] / ref - 1) * 100 if ref and t.get("mean") is not None else None
        pd = t.get("paired_diff_vs_ddp") or {}
        paired = (f"{fmt(pd.get('mean'), 4)} ± {fmt(pd.get('std'), 4)}" if pd.get("n") else "-")
        rows.append(
            [
                m,
                fmt(t.get("mean"), 4),
                fmt(t.get("std"), 4),
                fmt(t.get("min"), 4),
                fmt(t.get("max"), 4),
                fmt(rel, 2, "%") if rel is not None else "-",
                paired,
                t.get("n"),
                ", ".join(fmt(v, 4) for v in t.get("values", [])),
            ]
        )
    lines.append(
        md_table(
            [
                "method",
                "final eval loss (mean)",
                "std",
                "min",
                "max",
                "mean vs ddp",
                "paired diff vs ddp (same seed), mean ± std",
                "seeds",
                "per seed (seed order)",
            ],
            rows,
        )
    )
    uc = conv.get("update_closeness")
    if uc:
        lines += ["", "## Update closeness", "", uc_markdown(uc)]
    for f in plots:
        lines += ["", f"![{f}]({f})"]
    return "\n".join(lines) + "\n"


def uc_markdown(uc: dict) -> str:
    if "error" in uc:
        return f"not measured: {uc['error']}"
    lines = [
        f"||u_acco - u_adam|| / (||u_acco|| + ||u_adam||) on `{uc['model']}` ({uc['params']} parameters), "
        f"{uc['micro_batches']} micro-batches of {uc['batch_size']} x {uc['max_length']} per update "
        f"(acco: half at each point), lr {uc['lr']}, measured after each listed number of plain Adam steps:",
        "",
    ]
    rows = []
    for p in uc["points"]:
        rows.append([p["after_steps"], fmt(p["brief"], 4), fmt(p["algorithm"], 4), fmt(p["noise"], 4)])
    lines.append(md_table(["Adam steps before", "acco (theta~ = Opt_trial(theta, 1st half))",
                           "acco (theta~_t = Opt_trial(theta_{t-1}, half batch))",
                           "reference: Adam on another batch of the same size"], rows))
    lines += [
        "",
        f"mean: {fmt(uc['mean_brief'], 4)} / {fmt(uc['mean_algorithm'], 4)} / {fmt(uc['mean_noise'], 4)} "
        "(the paper's review quotes 0.07 to 0.11).",
    ]
    return "\n".join(lines)


def write_convergence_report(conv: dict, out: Path) -> list[str]:
    return write_report(conv, out, "convergence.md", convergence_markdown, plot_convergence)


def plot_convergence(conv: dict, out: Path) -> list[str]:
    plt = pyplot()
    curves = conv.get("curves", {})
    if not curves:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = colors_for(curves)
    for m, by_seed in curves.items():
        # align seeds on the eval points they share
        series = [s for s in by_seed.values() if s]
        if not series:
            continue
        common = sorted(set.intersection(*[set(x for x, _ in s) for s in series]))
        if not common:
            continue
        vals = [[dict(s)[x] for s in series] for x in common]
        mean = [sum(v) / len(v) for v in vals]
        ax.plot(common, mean, label=m, color=colors[m], marker=".")
        if len(series) > 1:
            ax.fill_between(
                common, [min(v) for v in vals], [max(v) for v in vals], color=colors[m], alpha=0.15
            )
    ax.set_xlabel("samples (sequences over all workers)")
    ax.set_ylabel("eval loss")
    ax.set_title("eval loss against samples (mean over seeds, band: min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "eval_loss.png", dpi=110)
    # zoomed on the last half
    xs = [x for by_seed in curves.values() for s in by_seed.values() for x, _ in s]
    ys = [y for by_seed in curves.values() for s in by_seed.values() for x, y in s if xs and x >= max(xs) / 2]
    if ys:
        ax.set_xlim(max(xs) / 2, max(xs) * 1.02)
        lo, hi = min(ys), max(ys)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
        ax.set_title("eval loss, second half of training")
        fig.savefig(out / "eval_loss_zoom.png", dpi=110)
    plt.close(fig)
    return ["eval_loss.png", "eval_loss_zoom.png"] if ys else ["eval_loss.png"]


def lr_sweep_markdown(sweep: dict, plots: list[str]) -> str:
    cfg, summary = sweep["config"], sweep["summary"]
    methods, table = cfg["methods"], summary["table"]
    lrs = [f"{float(x):g}" for x in cfg["learning_rates"]]
    lines = [
        f"# acco-bench lr-sweep: {cfg.get('data_path') or cfg.get('data')}, model {cfg.get('model')} "
        f"{cfg.get('model_size') or ''}",
        "",
        f"{cfg['hosts']} workers, {cfg['nb_steps_tot']} micro-batches of {cfg['batch_size']} x "
        f"{cfg['max_length']}, {cfg['grad_accum']} per worker per update (acco {cfg['grad_accum'] // 2} per "
        f"round), fixed batch; seeds {cfg['seeds']} (extra seeds {cfg.get('extra_seeds') or []} at ddp's "
        f"best learning rate and half of it); extra overrides: {' '.join(cfg.get('extra') or []) or 'none'}.",
        "",
        "Final eval loss, mean over seeds (n seeds, and min-max when more than one):",
        "",
    ]

    def cell(s: dict) -> str:
        if not s.get("n"):
            return "-"
        spread = f" [{s['min']:.3f}-{s['max']:.3f}]" if s["n"] > 1 else ""
        return f"{s['mean']:.3f} (n={s['n']}){spread}"

    rows = [[lr] + [cell(table[m].get(lr, {})) for m in methods] for lr in lrs]
    lines += [md_table(["learning rate"] + methods, rows), ""]
    best = summary.get("best", {})
    lines += [
        md_table(
            ["method", "best learning rate", "best final eval loss"],
            [
                [m, f"{best[m]['learning_rate']:g}", fmt(best[m]["final_eval_loss"])]
                for m in methods
                if m in best
            ],
        ),
        "",
    ]
    gap_rows = [[m, name.replace("_", " "), f"{g['learning_rate']:g}", g["seeds"], fmt(g["mean_loss"]),
                 fmt(g["ddp_mean_loss"]), fmt(g["ratio_to_ddp"])]
                for m, by_point in summary.get("gaps", {}).items() for name, g in by_point.items()]
    if gap_rows:
        lines += [
            "Gap to ddp at ddp's best learning rate and at half of it (same seeds):",
            "",
            md_table(
                ["method", "point", "learning rate", "seeds", "final eval loss", "ddp", "ratio to ddp"],
                gap_rows,
            ),
            "",
        ]
    ref = sweep.get("reference_check")
    if ref and "error" not in ref:
        lines += [
            f"Reference check at learning rate {ref['learning_rate']:g}, seed {ref['seed']}: training loss "
            "of the engine against the plain single-process recurrence (acco_bench.reference), first "
            f"{ref['updates']} updates:",
            "",
            md_table(
                ["method", "updates", "max abs difference"],
                [[m, len(r["engine"]), f"{r['max_abs_diff']:.2e}"] for m, r in ref["methods"].items()],
            ),
            "",
        ]
    elif ref:
        lines += [f"Reference check failed: {ref['error']}", ""]
    if sweep.get("failed"):
        lines += [
            "Failed runs: "
            + "; ".join(
                f"{f['method']} lr {f['learning_rate']:g} seed {f['seed']}: {f['error']}"
                for f in sweep["failed"]
            ),
            "",
        ]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_lr_sweep_report(sweep: dict, out: Path) -> list[str]:
    return write_report(sweep, out, "lr_sweep.md", lr_sweep_markdown, plot_lr_sweep)


def plot_lr_sweep(sweep: dict, out: Path) -> list[str]:
    plt = pyplot()
    table = sweep["summary"]["table"]
    fig, (ax, rax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = colors_for(table)  # variants (acco-int8, ...) get colors of their own
    for m, by_ratio in sweep["summary"].get("ratio_to_ddp", {}).items():
        points = sorted((float(lr), r) for lr, r in by_ratio.items() if r is not None)
        if points:
            rax.plot([x for x, _ in points], [r for _, r in points], marker="o", label=m, color=colors.get(m))
    rax.axhline(1.0, color=COLORS["ddp"], lw=1)
    rax.axhline(1.03, color="grey", ls="--", lw=1, label="ddp + 3%")
    rax.set_xscale("log")
    rax.set_ylim(0.8, 1.6)
    rax.set_xlabel("learning rate")
    rax.set_ylabel("final eval loss / ddp's (same seeds)")
    rax.set_title("ratio to ddp (clipped to 1.6)")
    rax.legend()
    for m, by_lr in table.items():
        points = sorted((float(lr), s) for lr, s in by_lr.items() if s.get("n"))
        if not points:
            continue
        xs = [x for x, _ in points]
        ax.plot(xs, [s["mean"] for _, s in points], marker="o", label=m, color=colors[m])
        ax.fill_between(
            xs, [s["min"] for _, s in points], [s["max"] for _, s in points], color=colors[m], alpha=0.15
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final eval loss")
    ax.set_title("final eval loss against learning rate (mean over seeds, band: min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "final_loss_vs_lr.png", dpi=110)
    plt.close(fig)
    return ["final_loss_vs_lr.png"]
