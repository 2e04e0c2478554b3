"""`make demo`: acco against ddp, two workers, the time each needs to reach ddp's loss.

Where the machine allows it (root and iproute2, as ``acco-bench cluster`` needs), the two workers
run on two emulated hosts joined by a slow link (100 Mbit/s, 1 ms), where ddp waits for every
comm round and acco computes through it; elsewhere on loopback, where there is no communication
to hide and the two take about the same time. Either way this is a small ``acco-bench race``
(acco_bench/race.py): ddp trains to its budget, acco until its eval loss reaches ddp's final one;
the tiny GPT-Neo on the synthetic corpus. The batch is fixed and the same for both (ddp 6
micro-batches per worker per update, acco 3 per round and two rounds), so ddp waits for every
round and acco computes through it; at 100 Mbit/s this model spends about a third of ddp's step
communicating, where acco's two rounds per update fit under its computation. (In the paper's
setting, acco computing more micro-batches while a round runs, this CPU-sized model at 100 Mbit/s
is comm-bound, acco's batch grows and it needs more samples: BENCHMARKS.md, "Time to the same
loss".) The plot shows eval loss against wall-clock training time.
The emulated hosts are removed at the end, on Ctrl-C and on failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from acco_bench import BenchError
from acco_bench.network import netns_unavailable_reason
from acco_bench.race import run_race
from acco_bench.settings import BenchSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument(
        "--nb-steps-tot", type=int, default=360, help="ddp's budget, micro-batches over both workers"
    )
    parser.add_argument("--bandwidth", default="100mbit", help="the emulated link's rate (a tc rate)")
    parser.add_argument(
        "--loopback", action="store_true", help="run on 127.0.0.1 even where a link can be emulated"
    )
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for both runs")
    args = parser.parse_args(argv)
    reason = None if args.loopback else netns_unavailable_reason()
    loopback = args.loopback or reason is not None
    settings = BenchSettings(
        methods=("ddp", "acco"),
        nb_steps_tot=args.nb_steps_tot,
        bandwidth=None if loopback else args.bandwidth,
        loopback=loopback,
        accumulate_while_waiting=False,
        grad_accum=6,
        eval_step=2,
        extra=tuple(args.extra),
    )
    if loopback:
        why = "--loopback" if args.loopback else reason.rstrip(".")
        print(
            f"demo: on loopback ({why}): with nothing to communicate over a slow link, acco has nothing to "
            "hide and the two tie in wall-clock time; run as root with iproute2 to see the difference.",
            flush=True,
        )
    else:
        print(
            f"demo: two emulated hosts on a {args.bandwidth} link (network namespaces, removed at the end)",
            flush=True,
        )
    out = Path(args.out)
    try:
        race = run_race(settings, out)
    except BenchError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    target = race["target_eval_loss"]
    if target is None or any("error" in r for r in race["methods"].values()):
        print(f"demo: a run failed; its logs are under {out}", file=sys.stderr)
        return 1
    header = (
        f"{'method':<8}{'time to ' + format(target, '.3f') + ' (s)':>22}{'samples then':>14}"
        f"{'MiB sent/worker':>17}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in race["methods"].items():
        t = r["time_to_target_s"]
        sent = r["bytes_sent_per_worker_mean"]
        print(f"{name:<8}{'not reached' if t is None else format(t, '.1f'):>22}"
              f"{'-' if t is None else format(r['samples_to_target'], '.0f'):>14}"
              f"{'-' if sent is None else format(sent / 2**20, '.1f'):>17}")
    acco, ddp = race["methods"]["acco"], race["methods"]["ddp"]
    if acco["time_to_target_s"] is not None and ddp["time_to_target_s"]:
        ratio = acco["time_to_target_s"] / ddp["time_to_target_s"]
        print(f"\nacco reached ddp's final eval loss in {ratio:.2f}x ddp's training time"
              + (f" ({1 / ratio:.2f}x sooner)" if ratio < 1 else "")
              + (" (loopback: nothing to hide, a tie is expected)" if loopback else ""))
    else:
        print("\nacco did not reach ddp's final eval loss within twice ddp's samples")
    print(f"plot: {out / 'race.png'}; table: {out / 'race.md'}; runs: {out / 'ddp'}, {out / 'acco'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
