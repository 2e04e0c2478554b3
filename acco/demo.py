"""`make demo`: the tiny GPT-Neo on the synthetic corpus, acco against ddp, side by side.

Both runs use 2 local workers, the same samples and the same effective batch (acco 2 micro-batches
per round and 2 rounds per update, ddp 4 per update; accumulate_while_waiting off so that the
batch stays fixed), then print a table and plot both curves against samples and against time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from acco.metrics import plot_runs

# Same effective batch: acco 2 micro-batches per round (two rounds per update), ddp 4 per update.
RUNS = {"acco": ["train=acco", "train.n_grad_accumulation=2"], "ddp": ["train=ddp", "train.n_grad_accumulation=4"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument("--nb-steps-tot", type=int, default=1600, help="micro-batches over all workers")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for both runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    summaries = {}
    for name, overrides in RUNS.items():
        run_dir = out / name
        cmd = [
            sys.executable, "-m", "acco.cli", *overrides,
            "launch.nproc=2", "train.accumulate_while_waiting=false", "train.overwrite_output_dir=true",
            f"train.nb_steps_tot={args.nb_steps_tot}", f"train.warmup={args.nb_steps_tot // 10}",
            f"train.output_dir={run_dir}", *args.extra,
        ]  # fmt: skip
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            print(f"demo: the {name} run failed", file=sys.stderr)
            return 1
        summaries[name] = json.loads((run_dir / "summary.json").read_text())

    header = f"{'method':<8}{'final eval loss':>17}{'wall time (s)':>15}{'tokens/s':>12}{'samples':>9}"
    print("\n" + header + "\n" + "-" * len(header))
    for name, s in summaries.items():
        print(f"{name:<8}{s['final_eval_loss']:>17.4f}{s['wall_time_s']:>15.1f}{s['tokens_per_s']:>12,.0f}{s['samples']:>9}")
    plot_runs({name: out / name for name in RUNS}, out / "compare.png")
    print(f"\nplots: {out / 'compare.png'}; runs: {', '.join(str(out / n) for n in RUNS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
