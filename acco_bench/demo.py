"""`make demo`: acco against ddp, two workers, the time each needs to reach ddp's loss.

Where the machine allows it (root and iproute2, as ``acco-bench cluster`` needs), the two workers
run on two emulated hosts joined by a link (1 ms) whose rate the demo sets so that ddp spends
40% of its step communicating (``--comm-share``, acco_bench/comm_share.py: two short ddp runs
measure this machine's compute and the link's cost first), the share where acco's recommended
configuration (the int8 estimate round, the ``auto`` split) is meant to win, whatever the speed of
the machine's cores; it prints the share and the rate it chose, and the share measured in the race.
Elsewhere the workers run on loopback, with nothing to hide: the demo says it cannot show the gain
there. Either way this is a small ``acco-bench race`` (acco_bench/race.py): ddp trains to its
budget, acco until its eval loss reaches ddp's final one; the tiny GPT-Neo on the synthetic corpus.
The batch is fixed and the same for both (ddp 6 micro-batches per worker per update, acco 3 per
round and two rounds), so ddp waits for every round and acco computes through it. The plot shows
eval loss against wall-clock training time. The emulated hosts are removed at the end, on Ctrl-C
and on failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from acco_bench import BenchError
from acco_bench.comm_share import rate_label
from acco_bench.network import netns_unavailable_reason
from acco_bench.race import run_race
from acco_bench.settings import DEMO_ACCO, DEMO_COMM_SHARE, KNOWN_METHODS, BenchSettings, base_method

# The tiny model's recipe LR (3e-3) with the race's warm-up (a tenth of the budget: 2 updates here)
# spiked on the synthetic corpus (eval loss up by 0.6 after update 14, grad norms of 24 and 50);
# half the LR, warmed up over 6 updates, trains smoothly to a lower loss, at the same ratio to
# ddp's time (BENCHMARKS-history.md, "From 5: the demo's learning rate"). A value given on the
# command line wins.
DEMO_TRAIN = {"train.learning_rate": "1.5e-3", "train.warmup": "72"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument(
        "--nb-steps-tot", type=int, default=240, help="ddp's budget, micro-batches over both workers"
    )
    parser.add_argument("--comm-share", type=float, default=None, metavar="S",
                        help=f"ddp's comm over its step, to set the rate by (default {DEMO_COMM_SHARE})")
    parser.add_argument("--bandwidth", default=None, help="the link's rate instead (a tc rate, 100mbit)")
    variants = [m for m in KNOWN_METHODS if base_method(m) == "acco"]
    parser.add_argument("--acco", default=DEMO_ACCO, choices=variants,
                        help=f"the acco variant to race against ddp (default {DEMO_ACCO}: the recommended)")
    parser.add_argument(
        "--loopback", action="store_true", help="run on 127.0.0.1 even where a link can be emulated"
    )
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for both runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bandwidth is not None and args.comm_share is not None:
        print("demo: --bandwidth and --comm-share exclude each other", file=sys.stderr)
        return 2
    share = DEMO_COMM_SHARE if args.bandwidth is None and args.comm_share is None else args.comm_share
    reason = None if args.loopback else netns_unavailable_reason()
    loopback = args.loopback or reason is not None
    settings = BenchSettings(
        methods=("ddp", args.acco),
        nb_steps_tot=args.nb_steps_tot,
        bandwidth=None if loopback else args.bandwidth,
        comm_share=None if loopback else share,
        loopback=loopback,
        accumulate_while_waiting=False,
        grad_accum=6,
        eval_step=2,
        retry_disturbed=1,  # a run on a drifting machine runs once more (acco_bench/drift.py)
        probe_updates=5,  # two probes of 5 updates (10 by default): the demo in 2.5 minutes on 2 cores
        extra=tuple(f"{k}={v}" for k, v in DEMO_TRAIN.items()
                    if not any(o.lstrip("+~").split("=", 1)[0] == k for o in args.extra)) + tuple(args.extra),
    )
    _say_where(args, loopback, reason, share)
    out = Path(args.out)
    try:
        race = run_race(settings, out)
    except BenchError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    if race["target_eval_loss"] is None or any("error" in r for r in race["methods"].values()):
        print(f"demo: a run failed; its logs are under {out}", file=sys.stderr)
        return 1
    _print_race(race, args, share, loopback)
    return 0


def _say_where(args, loopback: bool, reason: str | None, share: float | None) -> None:
    """Where the two workers run: on loopback (and why the gain cannot show), or on an emulated link."""
    if loopback:
        why = "--loopback" if args.loopback else reason.rstrip(".")
        print(
            f"demo: on loopback ({why}): with no slow link, acco has nothing to hide, so this run cannot "
            "show the gain (the two tie in wall-clock time); run as root with iproute2 to see it.",
            flush=True,
        )
    elif share is not None:
        print(f"demo: two emulated hosts (network namespaces, removed at the end); measuring ddp here to set "
              f"the link's rate so that ddp communicates {share:.0%} of its step", flush=True)
    else:
        print(f"demo: two emulated hosts on a {args.bandwidth} link (network namespaces, removed at the end)",
              flush=True)


def _print_race(race: dict, args, share: float | None, loopback: bool) -> None:
    """The race's link, its table (time to ddp's final eval loss, samples then, bytes sent) and
    acco's ratio to ddp."""
    out, target = Path(args.out), race["target_eval_loss"]
    if not loopback:
        got = race.get("comm_share_measured")
        print(f"\nlink: {rate_label(race.get('rate'))}"
              + (f", chosen for a comm share of {share:.2f}" if share is not None else "")
              + f"; ddp's comm share measured in the race: {'-' if got is None else format(got, '.2f')}")
    header = (
        f"{'method':<16}{'time to ' + format(target, '.3f') + ' (s)':>22}{'samples then':>14}"
        f"{'MiB sent/worker':>17}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in race["methods"].items():
        t = r["time_to_target_s"]
        sent = r["bytes_sent_per_worker_mean"]
        print(f"{name:<16}{'not reached' if t is None else format(t, '.1f'):>22}"
              f"{'-' if t is None else format(r['samples_to_target'], '.0f'):>14}"
              f"{'-' if sent is None else format(sent / 2**20, '.1f'):>17}")
    acco, ddp = race["methods"][args.acco], race["methods"]["ddp"]
    if acco["time_to_target_s"] is not None and ddp["time_to_target_s"]:
        ratio = acco["time_to_target_s"] / ddp["time_to_target_s"]
        print(f"\n{args.acco} reached ddp's final eval loss in {ratio:.2f}x ddp's training time"
              + (f" ({1 / ratio:.2f}x sooner)" if ratio < 1 else "")
              + (" (loopback: nothing to hide, a tie is expected)" if loopback else ""))
    else:
        print(f"\n{args.acco} did not reach ddp's final eval loss within twice ddp's samples")
    print(f"plot: {out / 'race.png'}; table: {out / 'race.md'}; runs: {out / 'ddp'}, {out / args.acco}")


if __name__ == "__main__":
    sys.exit(main())
