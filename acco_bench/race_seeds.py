"""``acco-bench race --seeds 0,1,2,3,4``: one race per seed, then each method's time to ddp's loss
over the seeds, as the median and the range (``seeds.json``, ``seeds.md``).

Each seed's race is a whole ``acco-bench race`` in ``OUT/seed-N`` (its own calibration, ddp and
target). A method is **ahead** of another only where its range over the seeds lies below the
other's, **behind** where it lies above, and **a tie** otherwise: one more seed moves a median, a
range that does not overlap survives it. A seed whose folder already holds a finished race of the
same settings is kept, so a sweep that was stopped goes on where it was; one of other settings is
refused before any race runs. ``acco-bench report OUT`` summarizes whatever ``seed-*`` folders
``OUT`` holds (links to races run apart included).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from acco_bench import BenchError
from acco_bench.race import REFERENCE
from acco_bench.report import fmt, load_json, md_table

# The settings two races must share to be seeds of one row (everything but the seed and what the
# calibration measures on the day: the rate, the machine).
SAME_ROW = ("hosts", "workers_per_node", "comm_share", "bandwidth_asked", "latency", "methods",
            "model", "model_size", "budget_micro_batches", "grad_accum", "batch_size", "max_length",
            "slow_worker", "accumulate_while_waiting", "mixed_precision", "loopback", "data",
            "eval_step", "extra", "scheduler")  # fmt: skip


def run_seeds(settings, seeds: list[int], out: Path, scheduler: str, eval_batches: int, log=print) -> dict:
    """One race per seed into ``out/seed-N`` (a finished one of the same settings is kept), then
    ``seeds.json`` and ``seeds.md``; returns the summary."""
    from acco_bench.race import run_race

    if not seeds or len(set(seeds)) != len(seeds):
        raise BenchError(f"--seeds needs distinct seeds, got {seeds}")
    planned = planned_race(settings, scheduler)
    for d in sorted(out.glob("seed-*")):  # before any race: a sweep refused at its end wastes hours
        if (d / "bench.json").exists() and (differ := _differs(load_json(d / "bench.json"), planned)):
            raise BenchError(f"{d} holds a race that differs from these settings in {', '.join(differ)}: "
                             "give another --out")
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        d = out / f"seed-{seed}"
        if (d / "bench.json").exists():
            log(f"[acco-bench] seed {seed}: {d} holds a finished race, kept")
            continue
        log(f"[acco-bench] seed {seed}: racing into {d}")
        run_race(replace(settings, seed=seed), d, scheduler=scheduler, eval_batches=eval_batches, log=log)
    return write_summary(out)


def load_races(out: Path) -> dict[int, dict]:
    """Every ``out/seed-N/bench.json``, by seed; refused when they are not one row's seeds."""
    races = {}
    for d in sorted(out.glob("seed-*")):
        if (d / "bench.json").exists():
            race = load_json(d / "bench.json")
            races[int(race["config"]["seed"])] = race
    if not races:
        raise BenchError(f"{out}: no seed-*/bench.json (acco-bench race --seeds writes them)")
    first_seed, first = next(iter(races.items()))
    for seed, race in races.items():
        if differ := _differs(race, first):
            raise BenchError(f"{out}: seed {seed}'s race differs from seed {first_seed}'s in "
                             f"{', '.join(differ)}: not seeds of one row (give another --out)")
    return dict(sorted(races.items()))


def planned_race(settings, scheduler: str) -> dict:
    """The row's keys of the race ``settings`` will run, as its bench.json will hold them."""
    config = {**settings.describe(), "methods": list(settings.methods),
              "budget_micro_batches": settings.nb_steps_tot, "scheduler": scheduler}
    return json.loads(json.dumps({"config": config, "comm_share_asked": settings.comm_share}, default=str))


def _differs(race: dict, other: dict) -> list[str]:
    return [k for k in SAME_ROW if _row_key(race, k) != _row_key(other, k)]


def _row_key(race: dict, key: str):
    cfg = race["config"]
    if key == "bandwidth_asked":  # a calibrated race sets the rate itself: only the asked one counts
        return None if race.get("comm_share_asked") is not None else cfg.get("bandwidth")
    if key == "comm_share":
        return race.get("comm_share_asked")
    if key == "methods":
        return sorted(cfg["methods"])
    return cfg.get(key)


def summarize(races: dict[int, dict]) -> dict:
    """Per method, over the seeds: time and samples to ddp's loss over ddp's (median, range; a
    seed where it did not reach the loss counts as infinitely slow), and every pair's verdict."""
    names = [m for m in next(iter(races.values()))["config"]["methods"] if m != REFERENCE]
    methods = {}
    for name in names:
        runs = [race["methods"].get(name, {"error": "not run"}) for race in races.values()]
        time = [_ratio(r, "time_to_target_vs_ddp") for r in runs]
        samples = [_ratio(r, "samples_to_target_vs_ddp") for r in runs]
        compute = [c for c in (_compute_vs_ddp(race, name) for race in races.values()) if c is not None]
        methods[name] = {
            "cpu_ms_per_micro_batch": _cpu_medians(runs),
            "compute_vs_ddp": compute,  # compute per micro-batch over ddp's in the same seed's race
            "compute_vs_ddp_median": statistics.median(compute) if compute else None,
            "compute_vs_ddp_range": [min(compute), max(compute)] if compute else None,
            "time_vs_ddp": time,
            "time_vs_ddp_median": statistics.median(time),
            "time_vs_ddp_range": [min(time), max(time)],
            "samples_vs_ddp_median": statistics.median(samples),
            "not_reached": sum(math.isinf(t) for t in time),
            "failed": sum("error" in r for r in runs),
            "drifted": sum(bool(r.get("drifted")) for r in runs),
        }
    shares = [r.get("comm_share_measured") for r in races.values()]
    rates = [r.get("rate_mbit_s") for r in races.values()]
    ddp_runs = [race["methods"].get(REFERENCE, {}) for race in races.values()]
    return {
        "seeds": list(races),
        "ddp_cpu_ms_per_micro_batch": _cpu_medians(ddp_runs),
        "comm_share_measured": shares,
        "rate_mbit_s": rates,
        "target_eval_loss": [r.get("target_eval_loss") for r in races.values()],
        "methods": methods,
        "verdicts": _verdicts({REFERENCE: [1.0] * len(races),
                               **{n: m["time_vs_ddp"] for n, m in methods.items()}}),
    }


def _cpu_medians(runs: list[dict]) -> dict[str, float]:
    """Each thread role's CPU milliseconds per micro-batch (race.py), the median over the seeds
    that measured it."""
    roles: dict[str, list[float]] = {}
    for r in runs:
        for role, seconds in (r.get("cpu_s_per_micro_batch") or {}).items():
            roles.setdefault(role, []).append(1000 * seconds)
    return {role: statistics.median(ms) for role, ms in roles.items()}


def _compute_vs_ddp(race: dict, name: str) -> float | None:
    mine = race["methods"].get(name, {}).get("compute_s_per_micro_batch")
    ddp = race["methods"].get(REFERENCE, {}).get("compute_s_per_micro_batch")
    return mine / ddp if mine and ddp else None


def _ratio(run: dict, key: str) -> float:
    value = run.get(key) if "error" not in run else None
    return math.inf if value is None else float(value)


def verdict(a: list[float], b: list[float]) -> str:
    """``ahead`` when every seed of ``a`` is faster than every seed of ``b``, ``behind`` the other
    way round, ``a tie`` when the ranges overlap."""
    if max(a) < min(b):
        return "ahead"
    if min(a) > max(b):
        return "behind"
    return "a tie"


def _verdicts(times: dict[str, list[float]]) -> list[dict]:
    names = list(times)
    return [{"method": a, "other": b, "verdict": verdict(times[a], times[b])}
            for i, a in enumerate(names) for b in names[i + 1:]]


def write_summary(out: Path) -> dict:
    summary = summarize(load_races(out))
    (out / "seeds.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "seeds.md").write_text(seeds_markdown(summary, out))
    return summary


def _span(values: list[float | None], digits: int) -> str:
    known = [v for v in values if v is not None]
    return f"{fmt(min(known), digits)}-{fmt(max(known), digits)}" if known else "-"


def _bold(verdict: str) -> str:
    return verdict if verdict == "a tie" else f"**{verdict}**"


def _one(ratio: float) -> str:
    return "not reached" if math.isinf(ratio) else fmt(ratio, 2, "x")


def _compute(m: dict) -> str:
    if m.get("compute_vs_ddp_median") is None:
        return "-"
    low, high = m["compute_vs_ddp_range"]
    return f"{fmt(m['compute_vs_ddp_median'], 2, 'x')} ({fmt(low, 2, 'x')} to {fmt(high, 2, 'x')})"


def _times(m: dict) -> str:
    low, high = m["time_vs_ddp_range"]
    return f"{_one(m['time_vs_ddp_median'])} ({_one(low)} to {_one(high)})"


def seeds_markdown(summary: dict, out: Path) -> str:
    n = len(summary["seeds"])
    rows = [[name, _times(m), ", ".join(_one(t) for t in m["time_vs_ddp"]),
             fmt(m["samples_vs_ddp_median"], 2, "x"), _compute(m), m["not_reached"], m["failed"],
             m["drifted"]]
            for name, m in summary["methods"].items()]  # fmt: skip
    lines = [
        f"# acco-bench race over {n} seeds ({', '.join(map(str, summary['seeds']))})",
        "",
        f"Each seed's race is in `{out.name}/seed-N` (race.md). ddp's comm share measured "
        f"{_span(summary['comm_share_measured'], 2)}, the link {_span(summary['rate_mbit_s'], 1)} Mbit/s, "
        f"ddp's final eval loss (the target) {_span(summary['target_eval_loss'], 4)}.",
        "",
        md_table(["method", "time to ddp's loss over ddp's: median (range)", "by seed",
                  "samples over ddp's (median)", "compute per micro-batch over ddp's: median (range)",
                  "not reached", "failed", "drifted"], rows),
        "",
        "A method is *ahead* of another only where its range lies below the other's; overlapping ranges "
        "are *a tie*. A seed where a method did not reach ddp's loss within twice ddp's samples (or "
        "failed) counts as slower than any that did. *Drifted*: the machine's speed moved during that "
        "seed's run (race.md).",
        "",
        md_table(["method", "against", "verdict"],
                 [[v["method"], v["other"], _bold(v["verdict"])] for v in summary["verdicts"]]),
    ]  # fmt: skip
    cpu = {REFERENCE: summary.get("ddp_cpu_ms_per_micro_batch")} | {
        n: m.get("cpu_ms_per_micro_batch") for n, m in summary["methods"].items()}
    if any(cpu.values()):
        roles = ("training", "comm", "transport", "other", "network")
        lines += ["", "CPU milliseconds per micro-batch by thread, the median over the seeds (race.md): what "
                  "a round costs beside the compute on shared cores.", "",
                  md_table(["method", *roles], [[n, *(fmt((c or {}).get(r), 1) for r in roles)]
                                                for n, c in cpu.items()])]  # fmt: skip
    return "\n".join(lines) + "\n"
