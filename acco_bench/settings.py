"""What one benchmark run is: the methods and their variants, :class:`BenchSettings` (everything
that defines a run, identical for every method of it, and each worker's Hydra overrides). A
benchmark that cannot run as asked raises :class:`acco_bench.BenchError`."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acco_bench import BenchError
from acco_bench.network import parse_rate

ALL_METHODS = ("ddp", "torch-ddp", "dpu", "wp", "acco", "diloco", "streaming-diloco")
# Variants run as methods of their own, side by side: name -> (train config, its overrides).
VARIANTS = {
    "acco-paper": ("acco", ("train.acco_estimate=paper",)),
    "acco-lean": ("acco", ("train.acco_estimate=lean",)),
    # One micro-batch per worker while the estimate round runs, the rest during the update round
    # (the split alone, both rounds exact: the loss sweep separates it from the int8 round)
    "acco-e1": ("acco", ("train.estimate_micro_batches=1",)),
    # The cheap estimate round (estimate_comm int8), with the even split and with one micro-batch
    # per worker while the estimate round runs (the rest during the update round) ...
    "acco-int8": ("acco", ("train.estimate_comm=int8",)),
    "acco-int8-e1": ("acco", ("train.estimate_comm=int8", "train.estimate_micro_batches=1")),
    # ... and with the split picked from the rounds' measured durations
    "acco-int8-auto": ("acco", ("train.estimate_comm=int8", "train.estimate_micro_batches=auto")),
    # ... and, while a round runs, each worker gathering at most c times the round's minimum
    # (accumulate_cap, 1.5 by default under --accumulate-while-waiting); -uncapped: the paper's own
    # setting, where the batch grows with the wait
    **{f"acco-cap{c}": ("acco", (f"train.accumulate_cap={c}",)) for c in ("1.25", "1.5", "2")},
    **{f"{m}-uncapped": (m, ("train.accumulate_cap=null",)) for m in ("acco", "dpu", "wp")},
    "acco-int8-auto-uncapped": ("acco", ("train.estimate_comm=int8", "train.estimate_micro_batches=auto",
                                         "train.accumulate_cap=null")),
    **{f"acco-int8-auto-cap{c}": ("acco", ("train.estimate_comm=int8", "train.estimate_micro_batches=auto",
                                           f"train.accumulate_cap={c}")) for c in ("1.25", "1.5", "2")},
    # Sharded inside the node (train.shard_inside_node; needs -nodes: the rounds run between nodes)
    **{f"{m}-sharded": (base, ("train.shard_inside_node=true", *extra)) for m, base, extra in (
        ("ddp", "ddp", ()), ("acco", "acco", ()),
        ("acco-int8-auto", "acco", ("train.estimate_comm=int8", "train.estimate_micro_batches=auto")))},
    # DiLoCo's sync period H (inner steps), for the sweep; streaming: 4 fragments, tau 1.
    **{f"diloco-h{h}": ("diloco", (f"train.sync_every={h}",)) for h in (5, 10, 20, 50)},
    **{f"streaming-diloco-h{h}": ("streaming-diloco", (f"train.sync_every={h}", "train.num_fragments=4",
                                                       "train.fragment_sync_delay=1")) for h in (8, 20, 50)},
}
# torch's FSDP2 HSDP over the (nodes, workers per node) mesh (train/torch-hsdp.yaml): known by name,
# not among the defaults
OTHER_METHODS = ("torch-hsdp",)
KNOWN_METHODS = ALL_METHODS + OTHER_METHODS + tuple(VARIANTS)
# Every method whose rounds have a two-level form (train.rounds): NAME runs the flat ring over every
# worker (train.rounds=flat), NAME-nodes the two-level rounds (acco/engine/nodes.py), so a benchmark
# on emulated nodes compares both layouts. torch-ddp and torch-hsdp take no train.rounds.
NODES_SUFFIX = "-nodes"
TWO_LEVEL = ("ddp", "dpu", "wp", "acco", "diloco", "streaming-diloco")


def split_nodes(method: str) -> tuple[str, bool]:
    """(the method without its -nodes suffix, whether it had one): acco-int8-auto-nodes is
    (acco-int8-auto, True)."""
    if method.endswith(NODES_SUFFIX):
        return method[: -len(NODES_SUFFIX)], True
    return method, False


def check_methods(methods) -> None:
    """One line for the methods that acco-bench cannot run: unknown names, or -nodes on a method
    without two-level rounds."""
    unknown = [m for m in methods if split_nodes(m)[0] not in KNOWN_METHODS]
    if unknown:
        raise BenchError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(KNOWN_METHODS)}, "
                         f"each of {', '.join(TWO_LEVEL)} and their variants also as NAME{NODES_SUFFIX} "
                         "(the two-level rounds)")
    unsharded = [m for m in methods if split_nodes(m)[0].endswith("-sharded") and not split_nodes(m)[1]]
    if unsharded:
        raise BenchError(f"{', '.join(unsharded)}: sharding inside the node runs its rounds between nodes; "
                         f"name it {unsharded[0]}{NODES_SUFFIX} (with --nodes and --workers-per-node)")
    flat_only = [m for m in methods if split_nodes(m)[1] and base_method(m) not in TWO_LEVEL]
    if flat_only:
        raise BenchError(f"{', '.join(flat_only)}: no two-level rounds (train.rounds) in "
                         f"{base_method(flat_only[0])}; {NODES_SUFFIX} goes with {', '.join(TWO_LEVEL)} and "
                         "their variants")


def method_overrides(method: str) -> tuple[str, ...]:
    """A method's own Hydra overrides: its variant's, then train.rounds for the methods that have it
    (flat without -nodes: the ring over every worker, as before emulated nodes)."""
    name, nodes = split_nodes(method)
    o = VARIANTS.get(name, (None, ()))[1]
    if base_method(name) in TWO_LEVEL:
        o += (f"train.rounds={'nodes' if nodes else 'flat'}",)
    return o


def model_settings(name: str, size: dict | None = None) -> dict:
    """acco's model config ``acco/conf/model/<name>.yaml`` as a dict, with ``size``'s keys over it."""
    from omegaconf import OmegaConf

    import acco

    path = Path(acco.__file__).resolve().parent / "conf" / "model" / f"{name}.yaml"
    if not path.exists():
        raise BenchError(f"no model config {name!r} ({path})")
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    cfg.update(size or {})
    return cfg


def base_method(method: str) -> str:
    """The train config a method or variant name runs (acco-lean: acco; acco-int8-auto-nodes: acco)."""
    method = split_nodes(method)[0]
    return VARIANTS[method][0] if method in VARIANTS else method


# A comm-bound default (measured on the 2-core VM, see BENCHMARKS.md): GPT-Neo "tiny" widened to
# 1.1M parameters, micro-batches of 8 x 96 tokens, 4 per worker per update, 100 Mbit/s links:
# ddp spends about 40% of its step in its comm round there.
DEFAULT_MODEL_SIZE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4}


# make demo's comm share: where acco's recommended configuration is meant to win (README, "which method")
DEMO_COMM_SHARE = 0.4
# the variant make demo races against ddp: acco's recommended configuration at that share
DEMO_ACCO = "acco-int8-auto"


@dataclass
class BenchSettings:
    """Everything that defines one run of the methods; identical for every method of the run. These
    are the defaults of acco-bench's flags too (acco_bench/cli.py reads them from here)."""

    hosts: int = 2  # emulated hosts: the nodes, each a network namespace
    workers_per_node: int = 1  # workers per host, unshaped between them (--nodes R --workers-per-node S)
    bandwidth: str | None = "100mbit"  # None: unshaped
    # ddp's comm over its step to calibrate the rate to (acco_bench/comm_share.py); None: --bandwidth
    comm_share: float | None = None
    probe_updates: int = 10  # per calibration run (comm_share.py); the first is left out of the medians
    latency: str | None = "1ms"  # one-way, per link (netem, or tbf + the delay line)
    methods: tuple[str, ...] = ALL_METHODS
    model: str = "tiny"
    model_size: dict = field(default_factory=lambda: dict(DEFAULT_MODEL_SIZE))
    nb_steps_tot: int = 200  # micro-batches over all workers, whatever the method
    grad_accum: int = 4  # micro-batches per worker per update (ddp); acco runs grad_accum // 2 per round
    batch_size: int = 8
    max_length: int = 96
    seed: int = 0
    slow_worker: tuple[int, float] | None = None  # (rank, factor)
    accumulate_while_waiting: bool = False  # acco (and dpu/wp): keep computing while a round runs
    mixed_precision: bool = False  # bf16 is slower than fp32 on this CPU
    loopback: bool = False
    timeout_s: float = 600.0  # per method
    repeats: int = 1  # every method runs that many times, interleaved; the median run is reported
    # run a method again (that many times at most) when other processes loaded the CPU
    retry_disturbed: int = 2
    # "normal": workers under the default scheduler; "batch": under SCHED_BATCH, so that gloo's
    # I/O thread, woken thousands of times a second by a shaped link, does not preempt the compute
    # thread on every wake-up (see BENCHMARKS.md: the emulation's cores are shared with the network)
    sched: str = "normal"
    threads: int | None = None  # torch threads per worker (default: cores // workers)
    data: str = "synthetic"
    data_path: str | None = None
    tokenizer: str | None = None
    eval_step: int | None = None  # None: only the final evaluation matters (a large value)
    extra: tuple[str, ...] = ()  # more Hydra overrides, for every method and rank

    @property
    def workers(self) -> int:
        """Every worker of the job: hosts x workers per host, ranked host by host."""
        return self.hosts * self.workers_per_node

    def validate(self) -> None:
        check_methods(self.methods)
        if not self.methods:
            raise BenchError("no method to run")
        if self.hosts < 1 or self.workers_per_node < 1:
            raise BenchError("--hosts (--nodes) and --workers-per-node must be >= 1")
        two_level = [m for m in self.methods if split_nodes(m)[1]]
        if two_level and (self.hosts < 2 or self.workers_per_node < 2):
            raise BenchError(f"{two_level[0]} runs the two-level rounds: it needs --nodes >= 2 and "
                             f"--workers-per-node >= 2 (got {self.hosts} x {self.workers_per_node}, where "
                             "they are the flat ring)")
        if self.repeats < 1:
            raise BenchError("--repeats must be >= 1")
        if self.sched not in ("normal", "batch"):
            raise BenchError(f"--sched must be normal or batch, got {self.sched!r}")
        if self.sched == "batch" and not hasattr(os, "SCHED_BATCH"):
            raise BenchError("--sched batch needs Linux (SCHED_BATCH)")
        if self.grad_accum < 2 or self.grad_accum % 2:
            raise BenchError(
                f"--grad-accum must be even (got {self.grad_accum}): acco runs half of it per round, "
                "two rounds per update, to match the other methods' effective batch"
            )
        if self.slow_worker is not None:
            rank, factor = self.slow_worker
            if not 0 <= rank < self.workers:
                raise BenchError(f"--slow-worker rank {rank} is not one of the {self.workers} workers")
            if factor < 1:
                raise BenchError(f"--slow-worker factor must be >= 1, got {factor}")
        if self.probe_updates < 3:
            raise BenchError(f"probe_updates must be >= 3 (the first is left out), got {self.probe_updates}")
        if self.comm_share is not None:
            if not 0 < self.comm_share < 1:
                raise BenchError(f"--comm-share must be between 0 and 1 (ddp's comm over its step), "
                                 f"got {self.comm_share:g}")
            if self.loopback:
                raise BenchError("--comm-share needs emulated hosts: on loopback there is no link to set")
        if self.bandwidth is not None:
            try:
                parse_rate(self.bandwidth)
            except ValueError as e:
                raise BenchError(str(e)) from e
        self._check_worker_configs()

    def _check_worker_configs(self) -> None:
        """Every method's workers get a config that composes (keys, types and values, as main.py
        checks them): a bad --override is one line before anything runs, not a failed run per method."""
        from acco.config import InputError, compose

        for method in self.methods:
            try:
                compose(self.overrides(method, Path("outputs"), 0))
            except InputError as e:
                raise BenchError(f"{method}'s workers cannot run: {e}") from None

    def grad_accum_for(self, method: str) -> int:
        return self.grad_accum // 2 if base_method(method) == "acco" else self.grad_accum

    def worker_threads(self) -> int:
        if self.threads:
            return self.threads
        return max(1, (os.cpu_count() or 1) // max(1, self.workers))

    def overrides(self, method: str, out_dir: Path, rank: int) -> list[str]:
        """The Hydra overrides of one worker."""
        o = [
            f"train={base_method(method)}",
            *method_overrides(method),
            f"model={self.model}",
            f"data={self.data}",
            f"train.nb_steps_tot={self.nb_steps_tot}",
            f"train.output_dir={out_dir}",
            f"train.seed={self.seed}",
            "launch.nproc=1",
            f"train.n_grad_accumulation={self.grad_accum_for(method)}",
            f"train.batch_size={self.batch_size}",
            f"train.max_length={self.max_length}",
            f"train.accumulate_while_waiting={str(self.accumulate_while_waiting).lower()}",
            f"train.use_mixed_precision={str(self.mixed_precision).lower()}",
            f"train.eval_step={self.eval_step if self.eval_step else 10**9}",
            "train.save=false",
        ]
        o += [f"model.{k}={v}" for k, v in self.model_size.items()]
        if self.data_path:
            o.append(f"data.path={self.data_path}")
        if self.tokenizer:
            o.append(f"model.tokenizer={self.tokenizer}")
        if self.slow_worker is not None and self.slow_worker[0] == rank:
            o.append(f"train.slowdown={self.slow_worker[1]}")
        o += list(self.extra)
        return o

    def describe(self) -> dict:
        d = asdict(self)
        d["methods"] = list(self.methods)
        d["slow_worker"] = list(self.slow_worker) if self.slow_worker else None
        d["grad_accum_per_method"] = {m: self.grad_accum_for(m) for m in self.methods}
        d["worker_threads"] = self.worker_threads()
        d["workers"] = self.workers
        return d


def layout_label(cfg: dict) -> str:
    """A run's hosts as its outputs say them: "2 hosts", or "2 nodes x 2 workers"."""
    s = int(cfg.get("workers_per_node") or 1)
    return f"{cfg['hosts']} hosts" if s == 1 else f"{cfg['hosts']} nodes x {s} workers"
