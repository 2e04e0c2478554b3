"""Markdown tables and matplotlib (Agg) plots for the acco-bench subcommands."""

from __future__ import annotations

import json
import math
from pathlib import Path

from acco_bench import drift
from acco_bench.settings import layout_label

COLORS = {"ddp": "#1f77b4", "torch-ddp": "#9467bd", "dpu": "#ff7f0e", "wp": "#8c564b", "acco": "#d62728",
          "acco-paper": "#e377c2", "acco-lean": "#2ca02c", "diloco": "#17becf", "streaming-diloco": "#bcbd22",
          "adam": "#7f7f7f"}
_SPARE = (
    "#2ca02c",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#c5b0d5",
    "#c49c94",
)


def colors_for(names) -> dict:
    """A distinct color per name: the method's own where it has one, else the next spare one unused
    in this plot (variants such as diloco-h10 would otherwise share matplotlib's cycle with them)."""
    names = list(names)
    out = {n: COLORS[n] for n in names if n in COLORS}
    spare = [c for c in _SPARE if c not in out.values()]
    for n in names:
        if n not in out:
            out[n] = spare.pop(0) if spare else None
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def fmt(x, digits: int = 3, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt(v, 2) for v in x) + "]"
    if isinstance(x, float):
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# cluster


def bench_table(bench: dict) -> str:
    rows = []
    for name, r in bench["methods"].items():
        if "error" in r:
            rows.append([name, "FAILED: " + r["error"].splitlines()[0]] + [""] * 14)
            continue
        rows.append(
            [
                name,
                fmt(r.get("step_time_s")),
                fmt(r.get("compute_s_per_update")),
                fmt(r.get("comm_s_per_update")),
                fmt(r.get("overlap_efficiency"), 2),
                fmt(r.get("samples_per_s"), 1),
                fmt(r.get("tokens_per_s"), 0),
                fmt(r.get("speedup_step_vs_ddp"), 2, "x"),
                fmt(r.get("speedup_step_vs_torch-ddp"), 2, "x"),
                fmt(r.get("speedup_samples_vs_ddp"), 2, "x"),
                fmt(r.get("micro_batches_per_update_by_worker")),
                fmt(r.get("final_eval_loss"), 4),
                fmt(r.get("time_to_target_loss_s"), 1),
                fmt(r.get("peak_gpu_mem_mb") or r.get("peak_rss_mb"), 0),
                fmt((r.get("load") or {}).get("other_cpu_cores"), 2),
                fmt(_mib(r.get("node_link_bytes_per_node_per_update")), 2),
            ]
        )
    return md_table(
        [
            "method",
            "step s",
            "compute s",
            "comm s",
            "overlap eff.",
            "samples/s",
            "tokens/s",
            "speedup vs ddp (step)",
            "vs torch-ddp (step)",
            "vs ddp (samples/s)",
            "micro-batches/update by worker",
            "final eval loss",
            "s to target loss",
            "peak MiB (GPU allocator on a GPU, else RSS)",
            "other load (cores)",
            "node link MiB per update",
        ],
        rows,
    )


def _mib(n: float | None) -> float | None:
    return None if n is None else n / 2**20


def bench_markdown(bench: dict, plots: list[str] | None = None) -> str:
    cfg = bench["config"]
    net = cfg.get("network", {})
    lines = [f"# acco-bench cluster: {layout_label(cfg)}, {net.get('note', '')}", ""]
    if "comm_share_measured" in bench:  # runs before --comm-share have none
        from acco_bench.comm_share import share_line

        lines += [share_line(bench, loopback=bool(cfg.get("loopback"))), ""]
    slow = cfg.get("slow_worker")
    lines.append(
        f"Model `{cfg['model']}` {cfg.get('model_size')}, micro-batch {cfg['batch_size']} x "
        f"{cfg['max_length']} tokens, {cfg['grad_accum']} micro-batches per worker per update (acco "
        f"{cfg['grad_accum'] // 2} per round, two rounds per update), nb_steps_tot {cfg['nb_steps_tot']}, "
        f"seed {cfg['seed']}, accumulate_while_waiting {cfg['accumulate_while_waiting']}, mixed precision "
        f"{cfg['mixed_precision']}, {cfg.get('worker_threads')} torch thread(s) per worker, scheduler "
        f"{cfg.get('sched', 'normal')}"
        + (f", rank {slow[0]} slowed down {slow[1]}x" if slow else "")
        + "."
    )
    m = cfg.get("machine", {})
    lines.append(f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), torch {m.get('torch')}, gloo.")
    lines.append("")
    lines.append(bench_table(bench))
    if warned := drift.warning(bench["methods"]):
        lines += ["", f"**{warned} (rank 0's median, acco_bench/drift.py).**"]
    b = bench.get("bounds") or {}
    if b:
        lines += [
            "",
            f"ddp: compute C = {fmt(b['ddp_compute_s'])} s, comm M = {fmt(b['ddp_comm_s'])} s per update "
            f"(comm {fmt(100 * b['ddp_comm_fraction'], 0)}% of C+M). Ideal speedup of one overlapped round "
            f"per update (C+M)/max(C,M) = {fmt(b['ideal_overlap'], 2)}x; an acco update runs two rounds, "
            f"plain acco's bound is (C+M)/max(C,2M) = {fmt(b['ideal_acco'], 2)}x; each acco variant's is its "
            "own (M_est: an int8 estimate round's time, 2k micro-batches per worker per update, e of them "
            "during it):",
            "",
        ]
        for name, a in bench["methods"].items():  # each acco variant against its own bound
            if a.get("bound_speedup") is not None:
                acc = (a.get("bound_spec") or {}).get("accumulate")
                lines.append(
                    f"- {name}: {fmt(a.get('speedup_samples_vs_ddp' if acc else 'speedup_step_vs_ddp'), 2)}x "
                    f"{'in samples/s' if acc else 'per update'}, {fmt(a.get('fraction_of_bound'), 2)} of "
                    f"its bound {a['bound_formula']} = {fmt(a['bound_speedup'], 2)}x"
                    + (f" ({a['bound_terms']})." if a.get("bound_terms") else ".")
                )
    lines += [
        "",
        "step s: median seconds per optimizer update; compute: slowest worker's compute per update; "
        "comm: ddp's time in its comm round, an overlapped method's comm-thread busy time (acco: both "
        "rounds), the smallest over workers; overlap eff. = max(compute, comm) / step; samples/s and "
        "tokens/s: steady state, first update excluded (samples = sequences); s to target loss: wall time "
        "until the 3-update running mean of the training loss first reaches "
        f"{fmt(bench.get('target_train_loss'), 3)}, "
        "the highest of the methods' final losses; other load: CPU cores used by "
        "processes other than the workers during the run (above 0.15 the timings are disturbed); node link "
        "MiB per update: the tx counters of the hosts' links over the run, per committed update and per "
        "node (null on loopback). Ratios are from this one run"
        + (
            f" (median of {cfg.get('repeats')} repetitions per method)"
            if (cfg.get("repeats") or 1) > 1
            else ""
        )
        + ".",
    ]
    for p in plots or []:
        lines += ["", f"![{p}]({p})"]
    return "\n".join(lines) + "\n"


def write_report(data: dict, out: Path, markdown_name: str, markdown, plot) -> list[str]:
    """The plots, then the Markdown that links them: a failed plot must never lose the numbers."""
    plots = []
    try:
        plots = plot(data, out)
    except Exception as e:
        print(f"[acco-bench] plotting failed: {e}")
    (out / markdown_name).write_text(markdown(data, plots))
    return plots


def write_bench_report(bench: dict, out: Path) -> list[str]:
    return write_report(bench, out, "bench.md", bench_markdown, plot_bench)


def plot_bench(bench: dict, out: Path) -> list[str]:
    plt = pyplot()
    ok = {n: r for n, r in bench["methods"].items() if "error" not in r}
    if not ok:
        return []
    names = list(ok)
    files = []
    # 1. step time against compute and comm
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(names))
    w = 0.27
    ax.bar(
        [i - w for i in x], [ok[n]["step_time_s"] or 0 for n in names], w, label="step (median)", color="#444"
    )
    ax.bar(list(x), [ok[n]["compute_s_per_update"] or 0 for n in names], w, label="compute", color="#2ca02c")
    ax.bar(
        [i + w for i in x], [ok[n]["comm_s_per_update"] or 0 for n in names], w, label="comm", color="#17becf"
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("seconds per optimizer update")
    net = bench["config"].get("network", {})
    ax.set_title(
        f"{layout_label(bench['config'])}, {net.get('bandwidth') or net.get('kind')}: time per update"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    files.append("step_time.png")
    # 2. training loss against wall time
    from acco_bench.analysis import read_jsonl

    fig, ax = plt.subplots(figsize=(7, 4))
    any_curve = False
    for n in names:
        run_dir = Path(ok[n].get("run_dir") or out / n)
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("type") == "train"]
        if rows:
            ax.plot([r["wall_time"] for r in rows], [r["loss"] for r in rows], label=n, color=COLORS.get(n))
            any_curve = True
    if any_curve:
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("training loss")
        ax.legend()
        ax.set_title("training loss against wall-clock time")
        fig.tight_layout()
        fig.savefig(out / "loss_vs_time.png", dpi=110)
        files.append("loss_vs_time.png")
    plt.close(fig)
    # 3. micro-batches per update, per worker
    mb = {n: ok[n].get("micro_batches_per_update_by_worker") for n in names}
    if all(isinstance(v, list) and v for v in mb.values()):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        k = max(len(v) for v in mb.values())
        w = 0.8 / k
        for r in range(k):
            ax.bar(
                [i + (r - (k - 1) / 2) * w for i in x],
                [mb[n][r] if r < len(mb[n]) else 0 for n in names],
                w,
                label=f"rank {r}",
            )
        ax.set_xticks(list(x), names)
        ax.set_ylabel("micro-batches per update")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "micro_batches.png", dpi=110)
        plt.close(fig)
        files.append("micro_batches.png")
    return files


# --------------------------------------------------------------------------------------------
# sweep


def sweep_markdown(sweep: dict, plots: list[str]) -> str:
    cfg = sweep["config"]
    methods = [m for m in cfg["methods"]]
    lines = [f"# acco-bench sweep: {layout_label(cfg)}, model `{cfg['model']}` {cfg.get('model_size')}", ""]
    header = ["link", "share asked", "rate Mbit/s", "ddp C s", "ddp M s", "comm % (share measured)",
              "(C+M)/max(C,M)", "(C+M)/max(C,2M)"]
    header += [f"{m} step s" for m in methods] + [f"{m} vs ddp" for m in methods if m != "ddp"]
    rows = []
    for p in sweep["points"]:
        b = p.get("bounds") or {}
        bps = p.get("bandwidth_bps")
        row = [p["label"], fmt(p.get("comm_share_asked"), 2), fmt(bps / 1e6 if bps else None, 1),
               fmt(b.get("ddp_compute_s")), fmt(b.get("ddp_comm_s")),
               fmt(100 * b["ddp_comm_fraction"], 0) if b.get("ddp_comm_fraction") is not None else "-",
               fmt(b.get("ideal_overlap"), 2, "x"), fmt(b.get("ideal_acco"), 2, "x")]
        ms = p["methods"]
        row += [
            fmt(ms.get(m, {}).get("step_time_s")) if "error" not in ms.get(m, {}) else "FAILED"
            for m in methods
        ]
        key = "speedup_samples_vs_ddp" if cfg.get("accumulate_while_waiting") else "speedup_step_vs_ddp"
        row += [fmt(ms.get(m, {}).get(key), 2, "x") for m in methods if m != "ddp"]
        rows.append(row)
    lines.append(md_table(header, rows))
    nets = {p["label"]: p["network"]["note"] for p in sweep["points"]}
    lines += ["", "Links: " + "; ".join(f"{k}: {v}" for k, v in nets.items()) + "."]
    for f in plots:
        lines += ["", f"![{f}]({f})"]
    return "\n".join(lines) + "\n"


def write_sweep_report(sweep: dict, out: Path) -> list[str]:
    return write_report(sweep, out, "sweep.md", sweep_markdown, plot_sweep)


def plot_sweep(sweep: dict, out: Path) -> list[str]:
    plt = pyplot()
    points = sweep["points"]
    if not points:
        return []
    methods = [m for m in sweep["config"]["methods"] if m != "ddp"]
    key = (
        "speedup_samples_vs_ddp" if sweep["config"].get("accumulate_while_waiting") else "speedup_step_vs_ddp"
    )
    labels = [p["label"] for p in points]
    x = list(range(len(points)))
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        ys = [p["methods"].get(m, {}).get(key) for p in points]
        ax.plot(
            x, [y if y is not None else float("nan") for y in ys], marker="o", label=m, color=COLORS.get(m)
        )
    ideal = [p.get("bounds", {}).get("ideal_overlap") for p in points]
    ideal_a = [p.get("bounds", {}).get("ideal_acco") for p in points]
    ax.plot(x, [y if y else float("nan") for y in ideal], ls="--", color="#999", label="(C+M)/max(C,M)")
    ax.plot(
        x,
        [y if y else float("nan") for y in ideal_a],
        ls=":",
        color=COLORS["acco"],
        label="acco bound (C+M)/max(C,2M)",
    )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, labels)
    ax.set_xlabel("link bandwidth per host")
    ax.set_ylabel(
        "speedup over ddp (step time)" if key == "speedup_step_vs_ddp" else "speedup over ddp (samples/s)"
    )
    ax.set_title("where overlap starts to pay")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sweep_speedup.png", dpi=110)
    plt.close(fig)
    return ["sweep_speedup.png"]


# --------------------------------------------------------------------------------------------
# convergence


def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
