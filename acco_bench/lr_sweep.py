"""``acco-bench lr-sweep``: final eval loss against the learning rate for every method, so that
"acco trains like ddp" is checked where ddp trains best, not only at one learning rate.

Every (learning rate, seed) is one ``acco-bench convergence`` run of the methods (same initial
weights, data order, budget in micro-batches and fixed batch for all), in ``OUT/lr-<LR>``. Then:

- ddp's best learning rate (lowest mean final eval loss over the first seeds), and the one
  nearest to half of it, get the extra seeds (``--extra-seeds``): the points that matter;
- each method's best learning rate and loss, and acco's gap to ddp at ddp's best learning rate
  and at half of it (paired by seed), go in ``lr_sweep.md`` with a plot of final eval loss
  against learning rate (``final_loss_vs_lr.png``);
- running again into the same ``--out`` with the same settings extends the sweep: new learning
  rates and seeds are added, the (learning rate, seed) pairs already done are not run again;
- the plain reference of the recurrences (:mod:`acco_bench.reference`, no engine code) runs
  beside the engine at ddp's best learning rate for the first ``--reference-updates`` updates:
  its training losses must equal the engine's, update by update, or the engine is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from acco_bench import BenchError
from acco_bench.analysis import read_jsonl, summary_stats
from acco_bench.convergence import run_convergence
from acco_bench.settings import BenchSettings, base_method, method_overrides


def _lr_dir(out: Path, lr: float) -> Path:
    return out / f"lr-{lr:g}"


def _with_lr(settings: BenchSettings, lr: float) -> BenchSettings:
    return replace(settings, extra=tuple(settings.extra) + (f"train.learning_rate={lr!r}",))


def _merge(into: dict, conv: dict) -> None:
    for method, by_seed in conv.get("runs", {}).items():
        into.setdefault(method, {}).update(by_seed)


def nearest(values: list[float], target: float) -> float:
    """The value closest to `target` on a log scale."""
    return min(values, key=lambda v: abs(math.log(v / target)))


def summarize(runs: dict, learning_rates: list[float], methods) -> dict:
    """Per method and learning rate: final eval loss statistics; best learning rates; acco's gaps."""
    table = {
        m: {
            f"{lr:g}": summary_stats(
                [r["final_eval_loss"] for r in runs.get(f"{lr:g}", {}).get(m, {}).values()]
            )
            for lr in learning_rates
        }
        for m in methods
    }
    best = {}
    for m in methods:
        scored = [(s["mean"], lr) for lr, s in table[m].items() if s.get("n")]
        if scored:
            loss, lr = min(scored)
            best[m] = {"learning_rate": float(lr), "final_eval_loss": loss}
    ratios = {m: {f"{lr:g}": paired_ratio(runs.get(f"{lr:g}", {}), m) for lr in learning_rates}
              for m in methods if m != "ddp"}
    gaps = {}
    if "ddp" in best:
        ddp_best = best["ddp"]["learning_rate"]
        points = {"ddp_best": ddp_best, "half_ddp_best": nearest(learning_rates, ddp_best / 2)}
        for m in methods:
            if m == "ddp":
                continue
            for name, lr in points.items():
                pairs = _pairs(runs.get(f"{lr:g}", {}), m)
                if pairs:
                    gaps.setdefault(m, {})[name] = {"learning_rate": lr, "seeds": len(pairs),
                                                   "mean_loss": sum(a for a, _ in pairs) / len(pairs),
                                                   "ddp_mean_loss": sum(b for _, b in pairs) / len(pairs),
                                                   "ratio_to_ddp": paired_ratio(runs.get(f"{lr:g}", {}), m)}
    return {"table": table, "best": best, "gaps": gaps, "ratio_to_ddp": ratios}


def _pairs(by_method: dict, method: str) -> list[tuple[float, float]]:
    """(method's, ddp's) final eval loss for every seed both ran to a finite loss."""
    ddp = by_method.get("ddp", {})
    pairs = [
        (r["final_eval_loss"], ddp[seed]["final_eval_loss"])
        for seed, r in by_method.get(method, {}).items()
        if seed in ddp
    ]
    return [
        (a, b) for a, b in pairs if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
    ]


def paired_ratio(by_method: dict, method: str) -> float | None:
    """Sum of `method`'s final eval losses over the seeds ddp also ran, over ddp's sum."""
    pairs = _pairs(by_method, method)
    return sum(a for a, _ in pairs) / sum(b for _, b in pairs) if pairs else None


def estimate_of(method: str, train: dict) -> str:
    """acco's estimate in a method's runs: its variant's override, else the train config's."""
    return next((o.split("=", 1)[1] for o in method_overrides(method)
                 if o.startswith("train.acco_estimate=")), train["acco_estimate"])


def reference_check(
    settings: BenchSettings, lr: float, seed: int, run_root: Path, updates: int, log=print
) -> dict:
    """Train losses of the engine's runs (read from their metrics.jsonl) against the plain reference's."""
    from acco_bench.reference_lm import build_case, simulate

    overrides = replace(settings, seed=seed).overrides("ddp", run_root / "reference", 0) + [
        f"train.learning_rate={lr!r}"
    ]
    overrides = [o for o in overrides if not o.startswith(("train=", "launch."))]
    case = build_case(overrides)
    result = {"learning_rate": lr, "seed": seed, "updates": updates, "methods": {}}
    for method in settings.methods:
        base = base_method(method)
        if base not in ("ddp", "dpu", "acco"):
            continue
        metrics = run_root / f"seed{seed}" / method / "metrics.jsonl"
        if not metrics.exists():
            continue
        estimate = estimate_of(method, case.train)
        engine = [r["loss"] for r in read_jsonl(metrics) if r.get("type") == "train"][:updates]
        ran = replace(case, train={**case.train, "acco_estimate": estimate})
        ref = simulate(
            ran, base, settings.hosts, settings.grad_accum, max_updates=len(engine), final_eval=False
        )["loss"]
        diff = max((abs(a - b) for a, b in zip(engine, ref)), default=float("nan"))
        result["methods"][method] = {"engine": engine, "reference": ref, "max_abs_diff": diff,
                                     "estimate": estimate if base == "acco" else None}
        log(f"[acco-bench] reference check {method}: {len(engine)} updates, max |engine - reference| "
            f"train loss {diff:.2e}")
    return result


def run_lr_sweep(
    settings: BenchSettings,
    learning_rates: list[float],
    seeds: list[int],
    extra_seeds: list[int],
    out: Path,
    reference_updates: int = 20,
    log=print,
) -> dict:
    if len(learning_rates) < 2 or any(not (lr > 0 and math.isfinite(lr)) for lr in learning_rates):
        raise BenchError(f"--learning-rates needs two or more positive numbers, got {learning_rates}")
    if not seeds:
        raise BenchError("no seed given")
    out.mkdir(parents=True, exist_ok=True)
    runs, previous = {}, _previous(out, settings)
    if previous is not None:  # the same settings: extend that sweep (more learning rates or seeds)
        runs = previous["runs"]
        learning_rates = learning_rates + [float(x) for x in previous["config"]["learning_rates"]]
        log(f"[acco-bench] lr-sweep: extending the sweep in {out} ({len(runs)} learning rates done)")
    learning_rates = sorted(set(learning_rates))
    sweep: dict = {"config": {**settings.describe(), "learning_rates": learning_rates, "seeds": seeds,
                              "extra_seeds": extra_seeds}, "runs": runs, "failed": []}

    def run(lr: float, seed_list: list[int], folder: Path) -> None:
        done = sweep["runs"].get(f"{lr:g}", {})
        seed_list = [s for s in seed_list if not all(str(s) in done.get(m, {}) for m in settings.methods)]
        if not seed_list:
            return
        log(f"[acco-bench] lr-sweep: learning rate {lr:g}, seeds {seed_list}")
        conv = run_convergence(_with_lr(settings, lr), seed_list, folder, closeness=False, log=log)
        _merge(sweep["runs"].setdefault(f"{lr:g}", {}), conv)
        sweep["failed"] += [{**f, "learning_rate": lr} for f in conv.get("failed", [])]
        write(sweep, out)

    for lr in learning_rates:
        run(lr, seeds, _lr_dir(out, lr))
    summary = summarize(sweep["runs"], learning_rates, settings.methods)
    if extra_seeds and "ddp" in summary["best"]:
        best = summary["best"]["ddp"]["learning_rate"]
        for lr in sorted({best, nearest(learning_rates, best / 2)}):
            run(lr, extra_seeds, _lr_dir(out, lr) / "extra-seeds")
    if reference_updates and "ddp" in summarize(sweep["runs"], learning_rates, settings.methods)["best"]:
        best = summarize(sweep["runs"], learning_rates, settings.methods)["best"]["ddp"]["learning_rate"]
        try:
            sweep["reference_check"] = reference_check(settings, best, seeds[0], _lr_dir(out, best),
                                                       reference_updates, log)
        except Exception as e:  # noqa: BLE001 - reported beside the sweep, which stands on its own
            log(f"[acco-bench] reference check failed: {type(e).__name__}: {e}")
            sweep["reference_check"] = {"error": f"{type(e).__name__}: {e}"}
    write(sweep, out)
    return sweep


def _previous(out: Path, settings: BenchSettings) -> dict | None:
    """The sweep already in `out`, if it ran with these very settings (learning rates and seeds aside)."""
    path = out / "lr_sweep.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    mine = json.loads(json.dumps(settings.describe(), default=str))
    theirs = {k: v for k, v in old["config"].items() if k not in ("learning_rates", "seeds", "extra_seeds")}
    return old if theirs == mine else None


def write(sweep: dict, out: Path) -> None:
    """lr_sweep.json (every run), lr_sweep.md (the tables) and the plot; also for a partial sweep."""
    from acco_bench.training_report import write_lr_sweep_report

    lrs = [float(x) for x in sweep["config"]["learning_rates"]]
    sweep["summary"] = summarize(sweep["runs"], lrs, sweep["config"]["methods"])
    (out / "lr_sweep.json").write_text(json.dumps(sweep, indent=2, default=str) + "\n")
    write_lr_sweep_report(sweep, out)
