"""``acco-bench report DIR``: a finished run's tables and plots rendered again from its JSON,
whichever subcommand wrote it. The one module that knows every kind of output, so that none of
them needs to know the others."""

from __future__ import annotations

from pathlib import Path

from acco_bench import BenchError
from acco_bench.report import load_json, write_sweep_report


def rerender_dir(d: Path) -> str:
    """``acco-bench report DIR``: re-render a finished run's tables and plots, whatever wrote it
    (cluster, race, a race's seeds, faults, sweep, lr-sweep, small batches, convergence); returns its
    Markdown."""
    try:
        return _rerender(d)
    except (ValueError, KeyError, TypeError) as e:  # a JSON file that is not such a result
        raise BenchError(f"{d}: not a finished acco-bench result ({type(e).__name__}: {e})") from e


def _rerender(d: Path) -> str:
    from acco_bench.cluster import rerender

    if (d / "race.md").exists() and (d / "bench.json").exists():
        from acco_bench.drift import recheck
        from acco_bench.race_report import write_race_report

        race = load_json(d / "bench.json")
        recheck(race)  # a race from before the drift check gets it from its run folders
        write_race_report(race, d)
        return (d / "race.md").read_text()
    if (d / "bench.json").exists() and "faulted" in load_json(d / "bench.json"):
        from acco_bench import faults

        (d / "bench.md").write_text(faults.markdown(load_json(d / "bench.json")))
        return (d / "bench.md").read_text()
    if (d / "bench.json").exists():
        rerender(d)
        return (d / "bench.md").read_text()
    if (d / "sweep.json").exists():
        write_sweep_report(load_json(d / "sweep.json"), d)
        return (d / "sweep.md").read_text()
    if (d / "lr_sweep.json").exists():
        from acco_bench import lr_sweep

        lr_sweep.write(load_json(d / "lr_sweep.json"), d)  # the summary is recomputed
        return (d / "lr_sweep.md").read_text()
    if (d / "batch_sizes.json").exists():
        from acco_bench.convergence import batch_sizes_markdown

        (d / "batch_sizes.md").write_text(
            batch_sizes_markdown(load_json(d / "batch_sizes.json"))
        )
        return (d / "batch_sizes.md").read_text()
    if (d / "convergence.json").exists():
        from acco_bench.training_report import write_convergence_report

        write_convergence_report(load_json(d / "convergence.json"), d)
        return (d / "convergence.md").read_text()
    if any(d.glob("seed-*/bench.json")):
        from acco_bench.race_seeds import write_summary

        write_summary(d)  # the seeds' races summarized again, whichever were added since
        return (d / "seeds.md").read_text()
    raise BenchError(f"{d}: no bench.json, sweep.json or convergence.json")
