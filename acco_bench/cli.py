"""``acco-bench``: measure acco against its baselines.

    acco-bench cluster     [--hosts 2 --bandwidth 100mbit --methods ddp,torch-ddp,dpu,wp,acco ...]
    acco-bench sweep       [--bandwidths 50mbit,200mbit,1000mbit,unshaped ...]
    acco-bench convergence --data ../shared/data/tinystories/TinyStories-valid-head.txt [--seeds 0,1 ...]
                           [--batch-sizes 1,2,4,8: small per-worker batches at the same samples]
    acco-bench race        [--hosts 2 --methods ddp,torch-ddp,acco,diloco,streaming-diloco
                           --bandwidth 100mbit]
                           [--nodes 2 --workers-per-node 4 --methods ddp,ddp-nodes,acco,acco-nodes:
                            emulated nodes, the flat ring against the two-level rounds]
    acco-bench lr-sweep    [--learning-rates 5e-4,1e-3,1.5e-3,2e-3,3e-3 --extra-seeds 1,2 --data PATH ...]
    acco-bench gpu         [--out DIR]        (needs CUDA; exits cleanly without it)
    acco-bench map         [--compute-s C --comm-s M --workers W --workers-per-node S ...]
                           [--params llama-13b: the memory per GPU counted by every engine on meta]
                           (where each method wins; trains nothing)
    acco-bench faults      [--workers 2 --faults 10 --save-step 2 --seed 0]  (a fault drill under torchrun)
    acco-bench report DIR                      (re-render a finished run's tables and plots)

Every subcommand writes JSON (the numbers), Markdown (a table) and PNG plots into ``--out``.
See BENCHMARKS.md for what was measured with them, and how.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from acco_bench import BenchError
from acco_bench.settings import BenchSettings, check_methods

# Every flag that sets a BenchSettings field defaults to that field's default (a subcommand may
# choose another, said where it is set): each default is stated once, in acco_bench/settings.py.
DEFAULTS = BenchSettings()


def _methods(text: str) -> tuple[str, ...]:
    ms = tuple(m.strip() for m in text.split(",") if m.strip())
    try:
        check_methods(ms)
    except BenchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return ms


def _slow(text: str) -> tuple[int, float]:
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--slow-worker takes RANK:FACTOR (e.g. 1:2), got {text!r}"
        ) from None


def _none(text: str) -> str | None:
    return None if text.lower() in ("none", "unshaped", "", "0") else text


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given: a rate and a comm share exclude each other."""

    def __call__(self, parser, ns, values, option_string=None):
        setattr(ns, self.dest, values)
        ns.given = {*getattr(ns, "given", ()), self.dest}


def _numbers(kind: type, flag: str, example: str):
    """An argparse type: comma-separated ``kind``s (int or float; '' gives none), or one line naming
    ``flag``. Every list flag of acco-bench parses through it."""
    words = "integers" if kind is int else "numbers"

    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {words} ({example}), got {text!r}") from None

    return parse


def _add_link(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The link: a rate (--bandwidth) or the comm share to set it by (--comm-share), and a latency."""
    share = ("ddp's comm over its step, S: measure ddp's compute here (short ddp runs), set the link's "
             "rate so that ddp communicates S of its step, report the rate and the share measured "
             "(acco_bench/comm_share.py); excludes --bandwidth")
    if sweep:
        p.add_argument("--bandwidths", action=_Given, default="50mbit,200mbit,1000mbit,unshaped",
                       help="comma-separated tc rates; 'unshaped' for unshaped links")
        p.add_argument("--comm-shares", action=_Given, type=_numbers(float, "--comm-shares", "0.3,0.45"),
                       default=None, metavar="0.3,0.45,0.6",
                       help=share.replace("S:", "one point per S:").replace("--bandwidth", "--bandwidths"))
    else:
        p.add_argument("--bandwidth", action=_Given, type=_none, default=DEFAULTS.bandwidth,
                       help="per-host link rate, a tc rate (100mbit); 'none' leaves links unshaped")
        p.add_argument("--comm-share", action=_Given, type=float, default=DEFAULTS.comm_share, metavar="S",
                       help=share)
    p.add_argument("--latency", type=_none, default=DEFAULTS.latency,
                   help="one-way delay per link, a tc time (1ms); 'none' adds none. netem where the "
                        "kernel has it, else TUN devices and a user-space delay line")


def _check_link(a) -> None:
    given = getattr(a, "given", set())
    for rate, share in (("bandwidth", "comm_share"), ("bandwidths", "comm_shares")):
        if {rate, share} <= given:
            raise BenchError(f"--{rate} and --{share.replace('_', '-')} exclude each other: give the link's "
                             "rate, or the comm share to set it by")


def _add_nodes(p: argparse.ArgumentParser) -> None:
    """Emulated nodes: R network namespaces of S workers each, the links between them shaped."""
    p.add_argument("--nodes", action=_Given, type=int, default=None, metavar="R",
                   help="emulated nodes: one network namespace each, its --workers-per-node workers talking "
                        "unshaped inside it, the link between nodes shaped (default --hosts's)")
    p.add_argument("--workers-per-node", action=_Given, type=int, default=DEFAULTS.workers_per_node,
                   metavar="S", help="workers per emulated node (ranked node by node; every worker gets "
                                     "ACCO_WORKERS_PER_NODE=S); NAME-nodes methods run the two-level rounds")


def _layout(a) -> tuple[int, int]:
    """(hosts, workers per host) from --hosts or --nodes/--workers-per-node, which exclude each other."""
    given = getattr(a, "given", set())
    if "hosts" in given and given & {"nodes", "workers_per_node"}:
        raise BenchError("--hosts N is one worker per host (--nodes N --workers-per-node 1): give --hosts, "
                         "or --nodes and --workers-per-node, not both")
    nodes = getattr(a, "nodes", None)
    return (a.hosts if nodes is None else nodes), getattr(a, "workers_per_node", DEFAULTS.workers_per_node)


def _add_common(p: argparse.ArgumentParser, out: str, nb_steps: int, methods=DEFAULTS.methods) -> None:
    d = DEFAULTS
    p.add_argument("--hosts", action=_Given, type=int, default=d.hosts,
                   help="number of emulated hosts (one worker each)")
    p.add_argument("--methods", type=_methods, default=tuple(methods),
                   help=f"comma-separated, run in this order (default {','.join(methods)})")
    p.add_argument("--model", default=d.model, help="model config name (acco/conf/model)")
    p.add_argument("--hidden-size", type=int, default=d.model_size["hidden_size"],
                   help="model.hidden_size override (0: the config's own)")
    p.add_argument("--num-layers", type=int, default=d.model_size["num_layers"],
                   help="model.num_layers override (0: the config's own)")
    p.add_argument("--num-heads", type=int, default=d.model_size["num_heads"],
                   help="model.num_heads override (0: the config's own)")
    p.add_argument("--nb-steps-tot", type=int, default=nb_steps,
                   help="training budget in micro-batches over all workers (same for every method; "
                        "race: 240 per worker unless given)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-batches per worker per update for ddp/torch-ddp/dpu/wp; acco runs half of it "
                        "per round, two rounds per update (same effective batch); must be even")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per sequence")
    p.add_argument("--seed", action=_Given, type=int, default=d.seed)
    p.add_argument(
        "--slow-worker",
        type=_slow,
        default=d.slow_worker,
        metavar="RANK:FACTOR",
        help="emulate a slower CPU worker: that rank sleeps (FACTOR-1) x each micro-batch's CPU time",
    )
    p.add_argument("--accumulate-while-waiting", action="store_true",
                   help="overlapped methods keep computing until the round is done, up to "
                        "train.accumulate_cap (1.5) x their micro-batches (the paper's setting, capped; "
                        "the batch per update then varies: compare samples/s). Default: fixed batch, so "
                        "seconds per update compare the overlap alone")
    p.add_argument("--mixed-precision", action="store_true", help="bf16 (slower than fp32 on most CPUs)")
    p.add_argument("--loopback", action="store_true",
                   help="no namespaces: local processes on 127.0.0.1, unshaped")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per method before a kill")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="run every method that many times (interleaved) and report the median run")
    p.add_argument("--retry-disturbed", type=int, default=d.retry_disturbed,
                   help="run a method again, at most that many times, when other processes used more than "
                        "0.15 CPU cores during its run (a shared machine) or when its compute per "
                        "micro-batch is 1.25x off the runs before it (the machine's speed moved)")
    p.add_argument("--sched", choices=("normal", "batch"), default=d.sched,
                   help="scheduling policy of the workers: batch (SCHED_BATCH) stops gloo's I/O thread from "
                        "preempting the compute thread at every packet on a machine without spare cores")
    p.add_argument(
        "--threads", type=int, default=d.threads, help="torch threads per worker (default cores // hosts)"
    )
    p.add_argument("--data", default=d.data,
                   help="a data config name (synthetic, tinystories, ...) or the path of a local text file")
    p.add_argument("--data-path", default=d.data_path, help="data.path, with a data config name in --data")
    p.add_argument(
        "--tokenizer",
        default=d.tokenizer,
        help="model.tokenizer (bpe, or a folder with vocab.json+merges.txt)",
    )
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for every worker (repeatable)")
    p.add_argument("--out", default=out, help=f"output folder (default {out})")


def _data(a) -> tuple[str, str | None]:
    """--data is a data config name (synthetic, text, tinystories, ...) or a local path (data=text)."""
    spec = a.data
    if a.data_path:
        return (spec if spec != "synthetic" else "text"), a.data_path
    if "/" in spec or Path(spec).exists():
        return "text", str(Path(spec).expanduser().resolve())
    return spec, None


def _settings(a, **kw) -> BenchSettings:
    data, data_path = _data(a)
    size = {k: v for k, v in (("hidden_size", a.hidden_size), ("num_layers", a.num_layers),
                              ("num_heads", a.num_heads)) if v}
    hosts, workers_per_node = _layout(a)
    nb_steps_tot = a.nb_steps_tot  # the race's default: as many micro-batches per worker at any size
    if nb_steps_tot is None:
        nb_steps_tot = a.budget_per_worker * hosts * workers_per_node
    return BenchSettings(
        hosts=hosts,
        workers_per_node=workers_per_node,
        methods=a.methods,
        model=a.model,
        model_size=size,
        nb_steps_tot=nb_steps_tot,
        grad_accum=a.grad_accum,
        batch_size=a.batch_size,
        max_length=a.max_length,
        seed=a.seed,
        slow_worker=a.slow_worker,
        accumulate_while_waiting=a.accumulate_while_waiting,
        mixed_precision=a.mixed_precision,
        loopback=a.loopback,
        timeout_s=a.timeout,
        threads=a.threads,
        repeats=a.repeats,
        retry_disturbed=a.retry_disturbed,
        sched=a.sched,
        data=data,
        data_path=data_path,
        tokenizer=a.tokenizer,
        extra=tuple(a.override),
        **kw,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="acco-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("cluster", help="every method, one after the other, on N emulated hosts")
    _add_common(p, "outputs/bench/cluster", DEFAULTS.nb_steps_tot)
    _add_nodes(p)
    _add_link(p)

    p = sub.add_parser("sweep", help="cluster at several bandwidths: speedup over ddp against bandwidth")
    _add_common(p, "outputs/bench/sweep", 120)
    _add_nodes(p)
    _add_link(p, sweep=True)

    p = sub.add_parser("convergence", help="eval loss against samples on real text, several seeds, "
                                           "and the acco/Adam update closeness")
    _add_common(p, "outputs/bench/convergence", 1600)
    from acco_bench.convergence import TINYSTORIES

    p.set_defaults(
        data=str(TINYSTORIES) if TINYSTORIES.exists() else "synthetic",
        hidden_size=0,
        num_layers=0,
        num_heads=0,
        max_length=64,
        loopback=True,
    )
    p.add_argument("--seeds", type=_numbers(int, "--seeds", "0,1"), default="0,1",
                   help="comma-separated seeds (default 0,1)")
    p.add_argument("--netns", dest="loopback", action="store_false",
                   help="run on emulated hosts instead of loopback (unshaped by default)")
    p.add_argument("--bandwidth", type=_none, default=None, help="with --netns: per-host link rate")
    p.add_argument("--eval-step", type=int, default=10, help="evaluate every that many updates")
    p.add_argument("--closeness-only", action="store_true", help="only the update-closeness measurement")
    p.add_argument("--no-closeness", action="store_true", help="skip the update-closeness measurement")
    p.add_argument("--closeness-steps", type=_numbers(int, "--closeness-steps", "1,10"),
                   default="1,10,50,100,200",
                   help="Adam steps before each closeness measurement")
    p.add_argument(
        "--batch-sizes",
        type=_numbers(int, "--batch-sizes", "1,2,4,8"),
        default=None,
        metavar="1,2,4,8",
        help="small per-worker batches: the methods at each of these sequences per micro-batch, with "
        "the same sequences in all (--nb-steps-tot x --batch-size); no closeness measurement",
    )

    p = sub.add_parser(
        "lr-sweep",
        help="final eval loss against the learning rate for ddp, acco and dpu, "
        "several seeds where ddp trains best; a reference check of the engine",
    )
    _add_common(p, "outputs/bench/lr-sweep", 800, methods=("ddp", "acco", "dpu"))
    p.set_defaults(loopback=True)
    p.add_argument("--learning-rates", type=_numbers(float, "--learning-rates", "1e-3,3e-3"),
                   default="5e-4,1e-3,1.5e-3,2e-3,3e-3",
                   help="comma-separated learning rates (train.learning_rate), two or more")
    p.add_argument("--seeds", type=_numbers(int, "--seeds", "0,1"), default="0",
                   help="seeds run at every learning rate (default 0)")
    p.add_argument("--extra-seeds", type=_numbers(int, "--extra-seeds", "1,2"), default="1,2",
                   help="more seeds at ddp's best learning rate and the one nearest half of it ('' for none)")
    p.add_argument(
        "--eval-step", type=int, default=0, help="also evaluate every that many updates (0: at the end)"
    )
    p.add_argument(
        "--reference-updates",
        type=int,
        default=20,
        help="updates of the plain reference run beside the engine at ddp's best learning rate (0: none)",
    )

    p = sub.add_parser(
        "race",
        help="time to ddp's final eval loss: ddp to its budget, then every other method "
        "until its eval loss reaches ddp's or it has seen twice ddp's samples",
    )
    from acco_bench.race import RACE_BUDGET_PER_WORKER, RACE_METHODS

    _add_common(p, "outputs/bench/race", None, methods=RACE_METHODS)
    p.set_defaults(budget_per_worker=RACE_BUDGET_PER_WORKER)
    p.set_defaults(accumulate_while_waiting=True, retry_disturbed=1)  # a run on a drifted machine: once more
    p.add_argument(
        "--fixed-batch",
        dest="accumulate_while_waiting",
        action="store_false",
        help="overlapped methods compute exactly their micro-batches per round (default: they keep "
        "accumulating while it runs, up to train.accumulate_cap, the paper's setting capped)",
    )
    _add_nodes(p)
    _add_link(p)
    p.add_argument("--eval-step", type=int, default=2, help="evaluate every that many updates (every method)")
    p.add_argument("--eval-batches", type=int, default=8, help="eval batches per worker per evaluation")
    p.add_argument(
        "--scheduler",
        choices=("constant", "cosine", "linear"),
        default="constant",
        help="LR schedule after a warm-up of a tenth of the budget (a decaying one ends at each run's "
        "own budget: ddp's, or the cap; see acco_bench/race.py)",
    )
    p.add_argument("--seeds", type=_numbers(int, "--seeds", "0,1,2"), default=None,
                   metavar="0,1,2,3,4",
                   help="one race per seed in OUT/seed-N (a finished one of the same settings is kept), "
                   "then each method's median and range over them: OUT/seeds.md (acco_bench/race_seeds.py)")

    p = sub.add_parser("report", help="re-render the tables and plots of a finished run (cluster runs: "
                                      "the figures are recomputed from the run folders)")
    p.add_argument("dir", help="the --out folder of an acco-bench cluster, sweep or convergence run")

    p = sub.add_parser(
        "gpu", help="GPT-Neo 125M bf16 through the engine vs a fused-AdamW loop; side-stream check"
    )
    from acco_bench import gpu

    gpu.add_arguments(p)

    p = sub.add_parser(
        "map",
        help="where each method wins: bounds from ddp's compute C and comm M per update, "
        "checked against BENCHMARKS.md, and the paper's settings; with --params, every method's memory "
        "per GPU counted by its engine on a meta-device model (trains nothing)",
    )
    from acco_bench import map as map_

    map_.add_arguments(p)

    p = sub.add_parser(
        "faults",
        help="a fault drill: a fixed-batch job under torchrun's elastic agent, workers "
        "killed K times (SIGKILL at random moments, SIGTERM during a save, a kill in "
        "the warm start), compared with an uninterrupted run of the same seed",
    )
    from acco_bench import faults

    faults.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_link(args)
        command = COMMANDS.get(args.command)
        return 2 if command is None else command(args)
    except BenchError as e:
        print(f"acco-bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("acco-bench: interrupted", file=sys.stderr)
        return 130


def _cluster(args) -> int:
    """One simulated cluster: every method at one link (bench.json, bench.md)."""
    from acco_bench.cluster import run_bench

    s = _settings(args, bandwidth=args.bandwidth, latency=args.latency, comm_share=args.comm_share)
    bench = run_bench(s, Path(args.out))
    print(f"[acco-bench] wrote {args.out}/bench.json and bench.md")
    print((Path(args.out) / "bench.md").read_text())
    return 1 if any("error" in r for r in bench["methods"].values()) else 0


def _sweep(args) -> int:
    """Every method over several bandwidths or comm shares (sweep.json, sweep.md)."""
    from acco_bench.cluster import run_sweep

    s = _settings(args, latency=args.latency)
    if args.comm_shares is not None:
        from acco_bench.cluster import run_share_sweep

        sweep = run_share_sweep(s, args.comm_shares, Path(args.out))
    else:
        sweep = run_sweep(s, [_none(b.strip()) for b in args.bandwidths.split(",") if b.strip()],
                          Path(args.out))
    print(f"[acco-bench] wrote {args.out}/sweep.json and sweep.md")
    print((Path(args.out) / "sweep.md").read_text())
    failed = any("error" in r for p in sweep["points"] for r in p["methods"].values())
    return 1 if failed or not sweep["points"] else 0


def _convergence(args) -> int:
    """Loss against samples over seeds, or over batch sizes (convergence.md, batch_sizes.md)."""
    from acco_bench.convergence import run_convergence

    seeds = args.seeds
    if args.data == "synthetic":
        print(
            "[acco-bench] the TinyStories slice (../shared/data) is not here: running on the "
            "synthetic corpus; pass --data PATH for real text",
            flush=True,
        )
    s = _settings(args, bandwidth=args.bandwidth, latency=None, eval_step=args.eval_step)
    if args.batch_sizes is not None:
        from acco_bench.convergence import run_batch_sizes

        if args.closeness_only:
            raise BenchError("--batch-sizes and --closeness-only exclude each other")
        table = run_batch_sizes(s, seeds, args.batch_sizes, Path(args.out))
        print(f"[acco-bench] wrote {args.out}/batch_sizes.json and batch_sizes.md")
        print((Path(args.out) / "batch_sizes.md").read_text())
        return 1 if table["failed"] else 0
    conv = run_convergence(
        s,
        seeds,
        Path(args.out),
        closeness=not args.no_closeness,
        closeness_only=args.closeness_only,
        closeness_steps=args.closeness_steps,
    )
    print(f"[acco-bench] wrote {args.out}/convergence.json and convergence.md")
    print((Path(args.out) / "convergence.md").read_text())
    return 1 if conv.get("failed") else 0


def _lr_sweep(args) -> int:
    """Eval loss over learning rates and seeds (lr_sweep.json, lr_sweep.md)."""
    from acco_bench.lr_sweep import run_lr_sweep

    s = _settings(args, bandwidth=None, latency=None, eval_step=args.eval_step or None)
    sweep = run_lr_sweep(s, args.learning_rates, args.seeds, args.extra_seeds, Path(args.out),
                         args.reference_updates)
    print(f"[acco-bench] wrote {args.out}/lr_sweep.json and lr_sweep.md")
    print((Path(args.out) / "lr_sweep.md").read_text())
    return 1 if sweep.get("failed") else 0


def _race(args) -> int:
    """Every method to the same eval loss (bench.json, race.md, race.png)."""
    from acco_bench.race import run_race

    if args.repeats != 1:
        raise BenchError("race runs every method once: --repeats does not apply (a disturbed run is "
                         "run again: --retry-disturbed)")
    if args.eval_step < 1 or args.eval_batches < 1:
        raise BenchError("--eval-step and --eval-batches must be >= 1")
    s = _settings(args, bandwidth=args.bandwidth, latency=args.latency, eval_step=args.eval_step,
                  comm_share=args.comm_share)
    if args.seeds is not None:
        return _race_seeds(args, s)
    race = run_race(s, Path(args.out), scheduler=args.scheduler, eval_batches=args.eval_batches)
    print(f"[acco-bench] wrote {args.out}/bench.json, race.md and race.png")
    print((Path(args.out) / "race.md").read_text())
    return (
        1
        if race["target_eval_loss"] is None or any("error" in r for r in race["methods"].values())
        else 0
    )


def _race_seeds(args, s) -> int:
    from acco_bench.race_seeds import run_seeds

    if "seed" in getattr(args, "given", ()):
        raise BenchError("--seed and --seeds exclude each other: give the seeds in --seeds")
    summary = run_seeds(s, args.seeds, Path(args.out), args.scheduler, args.eval_batches)
    print(f"[acco-bench] wrote {args.out}/seeds.json and seeds.md")
    print((Path(args.out) / "seeds.md").read_text())
    return 1 if any(m["failed"] for m in summary["methods"].values()) else 0


def _report(args) -> int:
    """A result folder's markdown rendered again from its JSON."""
    from acco_bench.rerender import rerender_dir

    print(rerender_dir(Path(args.dir)))
    return 0


def _gpu(args) -> int:
    """The single-device compute path on a GPU (acco_bench/gpu.py)."""
    from acco_bench import gpu

    return gpu.main(args)


def _map(args) -> int:
    """Where each method wins, from ddp's compute and comm per update (acco_bench/map.py)."""
    from acco_bench import map as map_

    return map_.run(args)


def _faults(args) -> int:
    """A fault drill under torchrun's elastic agent (acco_bench/faults.py)."""
    from acco_bench import faults

    return faults.main(args)


COMMANDS = {
    "cluster": _cluster,
    "sweep": _sweep,
    "convergence": _convergence,
    "lr-sweep": _lr_sweep,
    "race": _race,
    "report": _report,
    "gpu": _gpu,
    "map": _map,
    "faults": _faults,
}


if __name__ == "__main__":
    sys.exit(main())
