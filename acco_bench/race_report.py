"""``acco-bench race``'s report: ``race.md`` (the table, the comm share and the rate) and
``race.png`` (eval loss against training time and samples, the target marked)."""

from __future__ import annotations

from pathlib import Path


def race_markdown(race: dict, plots: list[str]) -> str:
    from acco_bench.comm_share import share_line
    from acco_bench.drift import DRIFT, warning
    from acco_bench.report import md_table

    cfg = race["config"]
    lines = [
        "# acco-bench race: time to ddp's final eval loss",
        "",
        _settings_line(race),
        "",
        *([share_line(race, bool(cfg.get("loopback"))), ""] if "comm_share_measured" in race else []),
        md_table(*_results(race)),
        "",
        "Training time excludes the evaluations' own seconds. The crossing is interpolated between the last "
        "evaluation above the target and the first at or below it; *crossing bracket* is the time between "
        "those two evaluations over the time to target (the crossing is known to within it). Bytes sent: tx "
        "counters of each host's link over the whole run (null on loopback); *node link MiB per update*: "
        "those counters summed over the hosts (the nodes), per committed update, per node; samples are "
        "sequences over all workers.",
        "",
        md_table(*_evaluations(race)),
        "",
        "*Compute per micro-batch*: rank 0's median; *vs reference*: over the median of every method's and "
        "of the calibration's probes (torch-ddp left out: its compute holds its all-reduce). *CPU ms per "
        "micro-batch*: every worker's CPU seconds by thread (the training thread with its set-up and "
        "evaluations; acco's comm thread; gloo's TCP loop; the other threads: gloo's own) and the emulated "
        "network's (the delay line), over the micro-batches all workers computed. Beyond "
        f"{DRIFT:g}x either way the machine's speed moved during that run (acco_bench/drift.py); *runs*: "
        "the run kept is the last, after re-runs of disturbed ones (--retry-disturbed).",
        "",
    ]
    if warned := warning(race["methods"]):
        lines += [f"**{warned}: run the race again on a quiet machine.**", ""]
    lines += [
        f"{n}: a worker failed after training finished (figures kept): "
        f"{r['worker_exit_error'].splitlines()[0]}\n"
        for n, r in race["methods"].items()
        if r.get("worker_exit_error")
    ]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _settings_line(race: dict) -> str:
    """The race's hosts, link, target, budget, schedule and evaluations, in one paragraph."""
    from acco_bench.report import fmt
    from acco_bench.settings import layout_label

    cfg = race["config"]
    return (
        f"{layout_label(cfg)}; {cfg['network']['note']}. Target: ddp's final eval loss at its budget of "
        f"{cfg['budget_micro_batches']} micro-batches, **{fmt(race.get('target_eval_loss'), 4)}**; the other "
        f"methods stop there or at {cfg['cap_micro_batches']} micro-batches. accumulate_while_waiting="
        f"{str(cfg['accumulate_while_waiting']).lower()}, LR schedule {cfg['scheduler']} (warm-up "
        f"{cfg['warmup']} micro-batches), evaluation every {cfg['eval_step']} updates on "
        f"{cfg['eval_batches_per_worker']} batches "
        "per worker."
        + (
            "".join(
                f" {m}: {', '.join(f'{k}={v}' for k, v in kv.items())}."
                for m, kv in cfg.get("method_settings", {}).items()
            )
        )
    )


def _results(race: dict) -> tuple[list[str], list[list]]:
    """The main table's header and rows: each method's time and samples to the target, its last
    eval loss, bytes sent and state held."""
    from acco_bench.report import fmt

    mb = 2**20
    rows = []
    for name, r in race["methods"].items():
        if "error" in r:
            rows.append([name, "failed: " + r["error"].splitlines()[0][:80]] + ["-"] * 9)
            continue
        sent = r.get("bytes_sent_per_worker_mean")
        link = r.get("node_link_bytes_per_node_per_update")
        state = r.get("state_bytes_per_worker")
        rows.append([name, fmt(r.get("time_to_target_s"), 1), fmt(r.get("time_to_target_vs_ddp"), 2, "x"),
                     fmt(r.get("samples_to_target"), 0), fmt(r.get("crossing_bracket"), 3),
                     fmt(r["final_eval_loss"], 4), f"{r['samples']} / {fmt(r['training_time_s'], 1)} s",
                     fmt(sent / mb if sent is not None else None, 1),
                     fmt(link / mb if link is not None else None, 2),
                     fmt(state / mb if state is not None else None, 1)])  # fmt: skip
    header = ["method", "time to target s", "vs ddp", "samples to target", "crossing bracket",
              "last eval loss", "samples / training time", "MiB sent per worker",
              "node link MiB per update", "state MiB per worker"]  # fmt: skip
    return header, rows


def _evaluations(race: dict) -> tuple[list[str], list[list]]:
    """The second table: how often each method evaluated, and its compute against the reference."""
    from acco_bench.report import fmt

    return (
        ["method", "eval every s (median)", "eval every samples", "one eval s", "evaluations",
         "compute per micro-batch s", "vs reference", "runs",
         "CPU ms per micro-batch: training / comm thread / transport / other threads / network"],  # fmt: skip
        [
            [
                n,
                fmt(r["eval_interval"]["median_s"], 2),
                fmt(r["eval_interval"]["median_samples"], 0),
                fmt(r["eval_interval"]["eval_s_median"], 2),
                r["eval_interval"]["evaluations"],
                fmt(r.get("compute_s_per_micro_batch"), 3),
                fmt(r.get("compute_vs_reference"), 2, "x") + (" **drifted**" if r.get("drifted") else ""),
                1 + (r.get("disturbed_attempts") or 0),
                cpu_split(r.get("cpu_s_per_micro_batch")),
            ]
            for n, r in race["methods"].items()
            if "error" not in r
        ],
    )


def cpu_split(per_micro_batch: dict | None) -> str:
    """The CPU milliseconds per micro-batch of each thread role, in one cell."""
    if not per_micro_batch:
        return "-"
    roles = ("training", "comm", "transport", "other", "network")
    return " / ".join(f"{1000 * per_micro_batch.get(role, 0.0):.1f}" for role in roles)


def plot_race(race: dict, out: Path) -> list[str]:
    from acco_bench.report import colors_for, pyplot
    from acco_bench.settings import layout_label

    plt = pyplot()
    palette = colors_for(race["methods"])
    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5))
    target = race.get("target_eval_loss")
    for name, r in race["methods"].items():
        if "error" in r or not r.get("eval_curve"):
            continue
        c = r["eval_curve"]
        color = palette[name]
        by_time.plot(
            [p["time_s"] for p in c], [p["eval_loss"] for p in c], marker=".", color=color, label=name
        )
        by_samples.plot(
            [p["samples"] for p in c], [p["eval_loss"] for p in c], marker=".", color=color, label=name
        )
        if r.get("time_to_target_s") is not None:
            by_time.plot([r["time_to_target_s"]], [target], "o", mfc="none", ms=10, color=color)
            by_samples.plot([r["samples_to_target"]], [target], "o", mfc="none", ms=10, color=color)
    for ax, xlabel in (
        (by_time, "training time (s, evaluations excluded)"),
        (by_samples, "samples (sequences)"),
    ):
        if target is not None:
            ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:.3f} (ddp's final)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg, net = race["config"], race["config"]["network"]
    link = (
        "loopback"
        if net["kind"] == "loopback"
        else f"{net['bandwidth'] or 'unshaped'} links, latency {net['latency']}"
    )
    fig.suptitle(f"race to ddp's final eval loss: {layout_label(cfg)}, {link}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "race.png", dpi=120)
    plt.close(fig)
    return ["race.png"]


def write_race_report(race: dict, out: Path) -> list[str]:
    plots = plot_race(race, out)
    (out / "race.md").write_text(race_markdown(race, plots))
    return plots
