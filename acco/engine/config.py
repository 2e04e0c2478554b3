"""What the engine is told (EngineSettings, checked as EngineConfig), what it reports after each
optimizer update (UpdateRecord), and the two errors it raises (ConfigError, CheckpointError).

Each engine setting is declared once, in ``EngineSettings``, with its meaning: ``EngineConfig`` is
those settings plus the method, checked; the trainer's ``TrainArgs`` (acco/config.py, the ``train``
group of the Hydra config) inherits the same fields, and ``acco/conf/train/*.yaml`` set only the
values a configuration changes. Units: ``nb_steps_tot`` and ``warmup`` count micro-batches over
all workers; ``n_warmup_steps`` counts optimizer updates.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

METHODS = ("acco", "ddp", "dpu", "wp", "torch-ddp", "torch-hsdp", "diloco", "streaming-diloco")
# Methods with no per-update collective: local steps, and every sync_every of them an outer step.
LOCAL_SGD_METHODS = ("diloco", "streaming-diloco")
ACCO_ESTIMATES = ("lean", "paper")
ESTIMATE_COMMS = ("full", "int8")
ROUNDS = ("nodes", "flat")
GRAD_ACCUM_DTYPES = ("fp32", "bf16")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # inductor's
COMPILE_SCOPES = ("blocks", "model")
SCHEDULERS = ("cosine", "linear", "constant")


class ConfigError(ValueError):
    """A configuration value the engine cannot run with."""


class ConfigWarning(UserWarning):
    """A configuration value accepted that is ignored or unlikely to be what was meant (the
    command line says it in one line)."""


_KEY_PREFIX: contextvars.ContextVar[str] = contextvars.ContextVar("acco_key_prefix", default="")
_ADVISED: set[str] = set()


def advise(text: str) -> None:
    """A ConfigWarning, once per process (a config is validated again wherever it is rebuilt)."""
    if text not in _ADVISED:
        _ADVISED.add(text)
        warnings.warn(text, ConfigWarning, stacklevel=5)


def advised() -> frozenset:
    """The advice said so far by this process."""
    return frozenset(_ADVISED)


def take_as_advised(texts) -> None:
    """Advice said by another process for the same job (the local launcher): not said again here."""
    _ADVISED.update(texts)


@contextlib.contextmanager
def unheard():
    """Validate without a word: warnings are ignored inside, and advice given inside is not taken
    as said (it is said where the values are used, by the same process)."""
    before = set(_ADVISED)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _ADVISED.intersection_update(before)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed by this run (every engine raises it, and the trainer's
    checkpoint checks)."""


def check_max_grad_norm(value, key: str = "max_grad_norm") -> None:
    """None, or a finite number >= 0 (0 and None turn clipping off)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf
    ):
        raise ConfigError(f"{key} must be a finite number >= 0 (0 or null: no clipping), got {value!r}")


@dataclass
class EngineSettings:
    """The engine's settings but the method, with the library's defaults (the paper's optimizer:
    AdamW, lr 6e-4, wd 0.1, betas (0.9, 0.95), cosine, no warm-up). No checks here: EngineConfig
    and TrainArgs check them, with the key names their callers use."""

    n_grad_accumulation: int = 1
    """Minimum micro-batches a worker computes per comm round. ddp/torch-ddp/torch-hsdp/dpu/wp: per
    update; acco: per round, and one update takes two rounds (so acco k matches ddp 2k)."""
    nb_steps_tot: int = 1000
    """The budget: micro-batch gradients over all workers that enter committed updates, whatever
    the method. The paper's runs: 50000 (acco/conf/train/base.yaml)."""
    learning_rate: float = 6e-4
    """AdamW's peak learning rate (after the warm-up)."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay, in [0, 1)."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay, in [0, 1)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    scheduler_name: str = "cosine"
    """The learning-rate schedule after the warm-up, one of SCHEDULERS: cosine or linear decay to 0
    at nb_steps_tot, or constant."""
    warmup: int = 0
    """Linear warm-up length in the unit of nb_steps_tot (micro-batches over all workers), so the
    schedule is the same function of data seen for every method and every worker speed."""
    use_mixed_precision: bool = False
    """bf16 compute and bf16 gradients on the wire, with fp32 master weights and AdamW state
    (torch-ddp: autocast and DDP's bf16 hook; torch-hsdp: FSDP2's bf16 parameters, gradients reduced in
    fp32); False: fp32 throughout."""
    accumulate_while_waiting: bool = True
    """Keep computing micro-batches until the comm round has finished (the paper's default).
    False: exactly n_grad_accumulation per round (fixed batch, for exact comparisons)."""
    accumulate_cap: float | None = 1.5
    """With accumulate_while_waiting: a worker computes at most this many times a round's minimum
    (n_grad_accumulation, or acco's split; rounded down, never below the minimum) while the round
    runs, then waits for it; null: no cap (the paper's). Where comm is long beside compute, or a
    worker is slower than the others, the uncapped batch grows with the wait and each update buys
    less loss per sample: with one worker 2x slower, uncapped acco, dpu and wp did not reach ddp's
    loss in twice its samples; capped at 1.5 acco tied ddp (0.91-1.11x its time, 3 seeds) and its
    int8 configuration won (0.62-0.68x) (docs/methods.md)."""
    n_warmup_steps: int = 0
    """That many first updates (updates, not micro-batches) of an overlapped method (acco, dpu, wp)
    run as sequential ddp."""
    max_grad_norm: float | None = 1.0
    """Clip the averaged gradient to this global L2 norm before the optimizer step (Hugging Face's
    Trainer default, 1.0); 0 or None: no clipping. acco's estimate round clips its own gradient."""
    acco_estimate: str = "lean"
    """acco's estimate round: "lean" adds half of the last estimate's error theta~_t - theta_t to
    Opt_trial(theta_t, g~_t), which damps the error's feedback loop; "paper" is Opt_trial(theta_t,
    g~_t) as the paper writes it (acco/engine/estimate.py's docstring; the lr sweep in BENCHMARKS.md)."""
    estimate_comm: str = "full"
    """acco's estimate round on the wire: "full" sends it as the update round does; "int8" sends its
    reduce-scatter as int8 blocks of 2048 elements with fp32 scales (an all-to-all, summed in fp32)
    and its all-gather as the int8 delta theta~_{t+1} - theta_t: a quarter of its bytes in fp32, half
    in bf16. The update round, which commits, stays exact (docs/algorithm.md, "The cheap estimate
    round"). Other methods have no estimate round: "full" only."""
    estimate_micro_batches: Any = None
    """acco: micro-batches a worker computes while the estimate round runs (e, an integer in
    [1, 2 n_grad_accumulation - 1]); the update round, and the warm start before the first round,
    take the rest of the update's 2 n_grad_accumulation, so the committed batch is unchanged. A
    short estimate round (estimate_comm=int8) then hides less computation and the long update round
    more. "auto": e = 2k M_est / (M_est + M_upd) from the rounds' measured durations, agreed by every
    worker (the largest proposal) and changed only where the committed batch stays 2k. null:
    n_grad_accumulation, the even split. With accumulate_while_waiting both are minima
    (docs/algorithm.md, "The cheap estimate round")."""
    grad_accum_dtype: str = "bf16"
    """Where a worker sums its micro-batches' gradients in mixed precision: "bf16" (in the bf16
    gradient buffer itself: one rounding per micro-batch) or "fp32" (a separate fp32 accumulator,
    +4 bytes per parameter; the sum is rounded to bf16 once, for the wire). fp32 training: fp32
    either way. bf16 by measurement: the same eval loss to 4 digits at 16 to 64 micro-batches per
    worker per update, for 4 bytes per parameter less (BENCHMARKS.md, "Numerics")."""
    rounds: str = "nodes"
    """How a round's collectives cross the job, one of ROUNDS: "nodes", in two levels (reduce-scatter
    inside each node, then between nodes on the node's shards; the all-gather in reverse), which sends
    (R - 1) / R of the payload through each node's link to the others instead of the flat ring's
    (W - 1) / W; "flat", one ring over every worker. The same where the job is one node, or one worker
    per node. The node layout is the launcher's (acco/engine/nodes.py). "nodes" by measurement: 0.65-0.67 of
    the flat ring's bytes across the node link for every method, and 0.82-0.86x its time to ddp's loss
    where the round is not hidden (ddp, acco; BENCHMARKS.md, "Nodes: 2 nodes x 2 workers, the
    two-level rounds")."""
    shard_inside_node: bool = False
    """ddp, dpu, wp, acco, diloco and streaming-diloco on the node layout (rounds=nodes): shard each
    block's parameters and gradients over the S workers of a node with FSDP2's fully_shard (the
    node's group; gradients reduce-scattered inside the node at every micro-batch), and run the comm
    rounds between nodes on the node's shards (acco/engine/node_shards.py; diloco: one replica per
    node, its inner AdamW, pseudo-gradients and outer step on each worker's 1/S). Each worker then
    holds 6/S bytes per parameter of replicated state instead of 6 (bf16), plus the blocks FSDP2
    unshards at a time; the optimizer state stays 1/W (diloco's: 1/S). Every worker of a node runs
    the same micro-batches per round: a fixed batch (accumulate_while_waiting off, or a cap that
    rounds to the minimum)."""
    bucket_cap_mb: float = 25.0
    """torch-ddp: DistributedDataParallel's bucket size in MiB (torch's default 25; BENCHMARKS.md's sweep)."""
    sync_every: int = 50
    """diloco / streaming-diloco (acco/engine/diloco.py): inner AdamW steps between two syncs of a
    fragment (H)."""
    num_fragments: int = 1
    """streaming-diloco: contiguous fragments of the model, synchronised in turn (F; 1 for diloco)."""
    fragment_sync_delay: int = 0
    """streaming-diloco: inner steps between a fragment's all-reduce launch and its use (tau < H / F)."""
    fragment_update_alpha: float = 0.0
    """streaming-diloco: the share of local progress kept when a fragment is merged (0 takes the
    global parameters)."""
    outer_lr: float = 0.7
    """diloco / streaming-diloco: the outer Nesterov SGD's learning rate."""
    outer_momentum: float = 0.9
    """diloco / streaming-diloco: the outer Nesterov SGD's momentum."""
    compile: Any = "auto"
    """torch.compile on each transformer block, in place, and on the loss's per-chunk pass
    (acco/engine/compiling.py): "auto" on CUDA only, true, false, or a torch.compile backend name
    ("aot_eager", "inductor"). The engine, its comm thread and the optimizer stay eager."""
    compile_mode: Any = None
    """inductor's mode where ``compile`` runs inductor: null (its default), "reduce-overhead" (CUDA
    graphs: less host time per kernel launch, for small micro-batches), "max-autotune" or
    "max-autotune-no-cudagraphs" (GEMM autotuning: longer compiles). Not yet measured on a GPU."""
    compile_scope: str = "blocks"
    """What ``compile`` compiles, one of COMPILE_SCOPES: "blocks", each repeated block on its own
    (short compiles, one graph per kind of block); "model", the model's transformer body (its
    ``base_model``) as one graph: fewer compiled calls per micro-batch and fusions across blocks,
    for small micro-batches where the host's time counts, at the cost of a longer first compile.
    Not yet measured on a GPU."""


@dataclass
class EngineConfig(EngineSettings):
    """What the engine is told: the method and the settings, checked on creation."""

    method: str = "acco"
    """One of METHODS (the trainer's key for it is the seed's name, ``method_name``)."""
    workers_per_node: int | None = None
    """The job's layout for rounds=nodes: workers per node (None: the launcher's environment,
    acco/engine/nodes.py's workers_per_node_from_env)."""

    def __post_init__(self) -> None:
        self.validate()

    def most_micro_batches(self, minimum: int) -> float:
        """The most micro-batches a worker computes while an overlapped round whose minimum is
        `minimum` runs: the minimum itself without accumulate_while_waiting, else accumulate_cap
        times it, rounded down and never below it; uncapped, no bound (inf)."""
        if not self.accumulate_while_waiting:
            return minimum
        cap = self.accumulate_cap
        return max(minimum, int(minimum * cap)) if cap else math.inf

    @property
    def fixed_batch(self) -> bool:
        """Whether every update takes the same micro-batches per worker whatever the timing: true for
        the methods that never compute while a round runs (ddp, torch-ddp, torch-hsdp, diloco), and for
        dpu, wp and acco where no round's minimum can grow under accumulate_cap (train=acco's one micro-batch
        per round at 1.5) or accumulate_while_waiting is off. Then a checkpoint keeps the gradients
        accumulated for the next round and a resume on the same world size is exact."""
        if self.method not in ("acco", "dpu", "wp"):
            return True
        k = int(self.n_grad_accumulation)
        if self.method != "acco":
            minima = {k}
        elif self.estimate_micro_batches == "auto":  # the split may move to any e in [1, 2k - 1]
            minima = set(range(1, 2 * k))
        else:
            e = self.estimate_micro_batches or k
            minima = {e, 2 * k - e}
        return all(self.most_micro_batches(m) == m for m in minima)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.scheduler_name not in SCHEDULERS:
            raise ConfigError(
                f"scheduler_name must be one of {', '.join(SCHEDULERS)}, got {self.scheduler_name!r}"
            )
        for name in ("n_grad_accumulation", "nb_steps_tot"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 < self.learning_rate < math.inf:
            raise ConfigError(f"learning_rate must be a positive finite number, got {self.learning_rate!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.acco_estimate not in ACCO_ESTIMATES:
            raise ConfigError(
                f"acco_estimate must be one of {', '.join(ACCO_ESTIMATES)}, got {self.acco_estimate!r}"
            )
        if self.rounds not in ROUNDS:
            raise ConfigError(f"rounds must be one of {', '.join(ROUNDS)}, got {self.rounds!r}")
        if self.estimate_comm not in ESTIMATE_COMMS:
            raise ConfigError(
                f"estimate_comm must be one of {', '.join(ESTIMATE_COMMS)}, got {self.estimate_comm!r}"
            )
        if self.estimate_comm != "full" and self.method != "acco":
            raise ConfigError(f"estimate_comm={self.estimate_comm} applies to acco's estimate round only; "
                              f"method {self.method} has none (estimate_comm=full)")
        self._validate_split()
        cap = self.accumulate_cap
        numeric = isinstance(cap, (int, float)) and not isinstance(cap, bool)
        if cap is not None and not (numeric and 1 <= cap < math.inf):
            raise ConfigError(f"accumulate_cap must be a number >= 1 or null (no cap), got {cap!r}")
        check_max_grad_norm(self.max_grad_norm)
        if self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ConfigError(
                f"grad_accum_dtype must be one of {', '.join(GRAD_ACCUM_DTYPES)}, "
                f"got {self.grad_accum_dtype!r}"
            )
        for name in ("warmup", "n_warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.warmup >= int(self.nb_steps_tot):  # legal (a short trial run), but rarely meant
            k = _KEY_PREFIX.get()
            advise(f"{k}warmup={self.warmup} is not below {k}nb_steps_tot={self.nb_steps_tot} (both count "
                    f"micro-batches over all workers): the learning rate never reaches {k}learning_rate="
                    f"{self.learning_rate}")
        if not 0 < self.bucket_cap_mb < math.inf:
            raise ConfigError(f"bucket_cap_mb must be a positive number of MiB, got {self.bucket_cap_mb!r}")
        self._validate_local_sgd()
        if self.shard_inside_node:
            self._validate_shard_inside_node()
        if not (self.compile in (True, False) or (isinstance(self.compile, str) and self.compile)):
            raise ConfigError(
                f"compile must be auto, true, false or a torch.compile backend, got {self.compile!r}"
            )
        if isinstance(self.compile, str) and self.compile != "auto":  # found now, not at the first step
            from torch._dynamo import list_backends

            if self.compile not in (known := list_backends(exclude_tags=())):
                raise ConfigError(
                    f"compile: {self.compile!r} is not a torch.compile backend (auto, true, false, or "
                    f"one of {', '.join(known)})"
                )

        self._validate_compile_mode()

    def _validate_shard_inside_node(self) -> None:
        if self.method not in ("ddp", "dpu", "wp", "acco", *LOCAL_SGD_METHODS):
            raise ConfigError("shard_inside_node applies to ddp, dpu, wp, acco, diloco and "
                              f"streaming-diloco; method {self.method} does not take it (torch-hsdp "
                              "shards inside the node itself)")
        if self.rounds != "nodes":
            raise ConfigError("shard_inside_node runs the rounds between nodes on the node's shards: "
                              "it needs rounds=nodes")
        if not self.fixed_batch:
            raise ConfigError("shard_inside_node needs every worker of a node to compute the same "
                              "micro-batches per round (FSDP2's collectives pair them): set "
                              "accumulate_while_waiting=false, or an accumulate_cap that rounds to "
                              "the minimum")

    def _validate_compile_mode(self) -> None:
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(
                f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}, got {self.compile_scope!r}"
            )
        if self.compile_mode is None:
            return
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode must be null or one of {', '.join(COMPILE_MODES)}, "
                              f"got {self.compile_mode!r}")
        if self.compile not in (True, "auto", "inductor"):
            raise ConfigError(f"compile_mode={self.compile_mode} is inductor's; compile={self.compile} "
                              "runs no inductor (compile=auto, true or inductor)")

    def _validate_split(self) -> None:
        e, most = self.estimate_micro_batches, 2 * int(self.n_grad_accumulation) - 1
        if e is not None and self.method != "acco":
            raise ConfigError(
                f"estimate_micro_batches applies to acco's estimate round only; method {self.method} "
                "has none (estimate_micro_batches=null)"
            )
        if e not in (None, "auto") and (isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= most):
            raise ConfigError(
                f"estimate_micro_batches must be auto, null (the even split) or an integer in [1, "
                f"2 n_grad_accumulation - 1 = {most}], got {e!r}"
            )
        if e == "auto" and most == 1:  # legal, but there is nothing to split
            k = _KEY_PREFIX.get()
            advise(f"{k}estimate_micro_batches=auto has no split to choose at {k}n_grad_accumulation=1: "
                   "an update's 2 micro-batches per worker go one to each round (set 2 or more per round)")

    def _validate_local_sgd(self) -> None:
        for name in ("sync_every", "num_fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_fragments > self.sync_every:
            raise ConfigError(
                f"num_fragments ({self.num_fragments}) must be <= sync_every ({self.sync_every}): "
                "one fragment is synchronised at a time"
            )
        if self.method == "diloco" and (self.num_fragments != 1 or self.fragment_sync_delay != 0):
            raise ConfigError(
                "diloco synchronises the whole model at once: num_fragments=1 and fragment_sync_delay=0 "
                "(method_name=streaming-diloco for fragments)"
            )
        spacing = self.sync_every // self.num_fragments
        if not 0 <= self.fragment_sync_delay < spacing:
            raise ConfigError(
                f"fragment_sync_delay must be in [0, sync_every // num_fragments = {spacing}), got "
                f"{self.fragment_sync_delay!r}: a fragment's all-reduce must land before the next one starts"
            )
        if not 0 <= self.fragment_update_alpha <= 1:
            raise ConfigError(f"fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha!r}")
        if not 0 < self.outer_lr < math.inf:
            raise ConfigError(f"outer_lr must be a positive finite number, got {self.outer_lr!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")

    @classmethod
    def from_mapping(cls, values, key_prefix: str = "") -> EngineConfig:
        """Build from any mapping that has (a superset of) the fields; `method_name` is accepted too.
        Errors name the keys as the caller knows them: ``key_prefix`` + field (``train.`` for the
        trainer's config, where `method` is ``method_name``)."""
        values = dict(values)
        method_key = "method"
        if "method" not in values and "method_name" in values:
            values["method"], method_key = values["method_name"], "method_name"
        names = {f.name for f in dataclasses.fields(cls)}
        prefix = _KEY_PREFIX.set(key_prefix)  # warnings name the keys alike
        try:
            cfg = cls(**{k: v for k, v in values.items() if k in names})
            cfg.key_prefix = key_prefix  # what the engine's own warnings name the keys with
            return cfg
        except ConfigError as e:
            if not key_prefix and method_key == "method":
                raise
            message = str(e)
            if message.startswith("method "):
                message = method_key + message[len("method"):]
            raise ConfigError(key_prefix + message) from None
        finally:
            _KEY_PREFIX.reset(prefix)


@dataclass
class UpdateRecord:
    """One committed optimizer update, as every worker sees it (identical on all ranks but the timers)."""

    step: int  # committed updates so far, this one included
    # over all workers, in committed updates so far: the budget's unit ("samples" in the checkpoints' meta
    # and metrics.jsonl)
    committed_micro_batches: int
    loss: float  # weighted mean training loss over this update's micro-batches, all workers
    lr: float
    micro_batches: list[int] = field(default_factory=list)  # this update's micro-batches, per worker
    compute_s: float = 0.0  # this worker's time computing gradients for this update
    wait_s: float = 0.0  # this worker's time waiting for the comm round (idle)
    comm_s: float = 0.0  # comm rounds' busy time for this update (collectives + optimizer step)
    wall_time: float = 0.0  # seconds since the engine's run started
    # Summed loss weight of this update over all workers: target tokens for a token-normalised
    # loss (the trainer's), else micro-batches.
    weight: float = 0.0
    # Global L2 norm of this update's averaged gradient, before clipping (as Hugging Face logs it;
    # nan with clipping off, which then costs nothing).
    grad_norm: float = float("nan")
    # acco: the split in effect, e of the 2k micro-batches per worker computed while an estimate
    # round runs (estimate_micro_batches; it moves with auto); None for the other methods.
    estimate_micro_batches: int | None = None
    # Some worker was asked to stop (`request_stop`, a signal): every worker's record of this same
    # update says so, and the caller stops after it (checkpoint first: nothing is in flight).
    stop: bool = False

    @property
    def batch_micro_batches(self) -> int:
        return sum(self.micro_batches)
