"""DecoupledTrainer: a drop-in for transformers.Trainer that trains with acco (or a baseline).

    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer,
                               train_dataset=ds["train"], eval_dataset=ds["validation"],
                               text_column_name="text", args=train_config)
    trainer.train()

The loop is thin: it turns the datasets into per-worker micro-batch streams, hands the engine a
loss function, and around the engine's updates it logs, evaluates and saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from acco import checkpoint
from acco.data import (
    DEFAULT_CACHE_DIR,
    IGNORE_INDEX,
    DataError,
    MicroBatchStream,
    Rows,
    blocks_of,
    cached_instructions,
    eval_batches,
    is_hf_dataset,
    pack_documents,
    pad_token_ids,
    split_train_eval,
    token_stream,
    tokenize_instructions,
)
from acco.engine import ConfigError, EngineConfig, build_engine, progress
from acco.engine.config import check_max_grad_norm
from acco.launch import after_rank0, every_rank_at, init_distributed
from acco.metrics import RunLog


@dataclass
class TrainArgs:
    """The seed's train keys (same names), plus output_dir, seed and a few run settings."""

    method_name: str = "acco"
    batch_size: int = 8  # sequences per micro-batch
    n_grad_accumulation: int = 1
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    nb_steps_tot: int = 1000  # micro-batches over all workers
    max_length: int = 1024
    scheduler_name: str = "cosine"
    warmup: int = 0  # micro-batches over all workers
    use_mixed_precision: bool = False
    accumulate_while_waiting: bool = True
    n_warmup_steps: int = 0
    max_grad_norm: float | None = 1.0  # clip the averaged gradient's global norm (0 or null: off)
    acco_estimate: str = "lean"  # acco's estimate round: "lean", or the paper's form "paper" (acco/engine/comm.py)
    eval: bool = True
    eval_step: int = 50  # optimizer updates between evaluations
    eval_batch_size: int | None = None
    eval_fraction: float = 0.05  # carved out of the training data when no eval set is given
    max_eval_batches: int | None = None  # per worker, None: the whole eval set
    save: bool = True  # the final model (save_pretrained) and a final checkpoint
    save_step: int = 0  # also checkpoint every that many updates (0: only at the end)
    save_total_limit: int | None = None  # keep only the newest checkpoints
    resume_from_checkpoint: str | bool | None = None  # a checkpoint folder, or "latest" (true) in output_dir
    overwrite_output_dir: bool = False
    output_dir: str = "outputs/run"
    seed: int = 0
    log_step: int = 10
    slowdown: float = 1.0  # benchmarks: this worker sleeps (slowdown - 1) x its compute time
    cache_dir: str = DEFAULT_CACHE_DIR
    timeout_s: float = 30.0  # collectives give up after this long: a dead or stalled worker

    def __post_init__(self) -> None:
        for name in ("batch_size", "nb_steps_tot", "n_grad_accumulation", "max_length", "eval_step", "log_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
        if self.save_step < 0:
            raise ConfigError(f"train.save_step must be >= 0, got {self.save_step!r}")
        limit = self.save_total_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"train.save_total_limit must be null (keep all) or a positive integer, got {limit!r}")
        if self.resume_from_checkpoint is True:  # transformers' convention: the newest checkpoint
            self.resume_from_checkpoint = "latest"
        elif self.resume_from_checkpoint is False or self.resume_from_checkpoint == "":
            self.resume_from_checkpoint = None
        if not self.learning_rate > 0:
            raise ConfigError(f"train.learning_rate must be positive, got {self.learning_rate!r}")
        check_max_grad_norm(self.max_grad_norm, "train.max_grad_norm")
        if self.slowdown < 1:
            raise ConfigError(f"train.slowdown must be >= 1, got {self.slowdown!r}")
        self.engine_config()  # validates method, scheduler, betas

    @classmethod
    def from_any(cls, args: Any) -> TrainArgs:
        """From a TrainArgs, a dict, an OmegaConf config, or any dataclass/object with the keys."""
        if isinstance(args, cls):
            return args
        if args is None:
            return cls()
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(args, DictConfig):
                args = OmegaConf.to_container(args, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        if dataclasses.is_dataclass(args):
            args = dataclasses.asdict(args)
        elif not isinstance(args, Mapping):
            args = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        names = {f.name for f in dataclasses.fields(cls)}
        args = _drop_seed_only_keys(dict(args))
        unknown = sorted(set(args) - names)
        if unknown:
            raise ConfigError(f"unknown train key(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return cls(**_numbers_from_strings(cls, args))

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_mapping(dataclasses.asdict(self))


# Keys of the seed repository's train configs (the paper's Listing 1) that acco does not need:
# accepted so those configs run unchanged, with one warning; a real typo still fails.
_SEED_ONLY_KEYS = {
    "group_by_length": False, "dataloader_num_workers": None, "dataloader_pin_memory": None,
    "dataloader_persistent_workers": None, "label_smoothing_factor": 0, "run_baseline_ddp": None,
    "run_expe_slow": False, "const_len_batch": False, "finetune": None, "gradient_accumulation_steps": None,
}


def _numbers_from_strings(cls, args: dict) -> dict:
    """YAML 1.1 (PyYAML) reads ``6e-4`` as a string: turn such strings into the field's number."""
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for key, value in args.items():
        kind = types[key].split("|")[0].strip()
        if isinstance(value, str) and kind in ("int", "float"):
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"train.{key} must be a number, got {value!r}") from None
            args[key] = int(number) if kind == "int" and number.is_integer() else number
    return args


def _drop_seed_only_keys(args: dict) -> dict:
    """Remove the seed's keys that have no effect here; refuse those whose value would change
    the training if it were honoured (label smoothing, length grouping, ...)."""
    seen = [k for k in _SEED_ONLY_KEYS if k in args]
    for key in seen:
        value, neutral = args.pop(key), _SEED_ONLY_KEYS[key]
        if neutral is not None and value not in (None, neutral):
            raise ConfigError(f"train.{key}={value!r} is not supported by acco (only {neutral!r})")
        if key == "run_baseline_ddp" and value and args.get("method_name", "ddp") != "ddp":
            raise ConfigError("train.run_baseline_ddp=true conflicts with method_name="
                              f"{args.get('method_name')!r}: set method_name=ddp instead")
    if seen:
        warnings.warn(f"ignoring the seed's train key(s) {', '.join(seen)}: they have no effect in acco",
                      stacklevel=3)
    return args


def causal_lm_loss(model, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token losses, number of target tokens): the engine divides by the tokens
    summed over micro-batches and workers, so a padded or masked batch counts each token once."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (labels != IGNORE_INDEX).sum()


class _OnDevice:
    """Moves each micro-batch to the device (and, for benchmarks, slows this worker down)."""

    def __init__(self, stream, device: torch.device, slowdown: float = 1.0):
        self.stream, self.device, self.slowdown = stream, device, slowdown
        self._last = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.slowdown > 1 and self._last is not None:
            # Emulate a slower accelerator: stretch the micro-batch that just finished.
            time.sleep((self.slowdown - 1) * (time.perf_counter() - self._last))
        batch = next(self.stream)
        self._last = time.perf_counter()
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


# Dense bf16 peaks (FLOP/s) of common accelerators, by a substring of their name.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)


def _fault() -> dict | None:
    """Fault injection for tests: ACCO_TEST_FAULT="rank=1,step=6,mode=exit|hang|nan"."""
    spec = os.environ.get("ACCO_TEST_FAULT")
    if not spec:
        return None
    fields = dict(item.split("=", 1) for item in spec.split(","))
    return {"rank": int(fields["rank"]), "step": int(fields["step"]), "mode": fields["mode"]}


def _inject_fault_after(step: int, rank: int) -> None:
    fault = _fault()
    if fault is None or fault["rank"] != rank or fault["step"] != step:
        return
    if fault["mode"] == "exit":
        os._exit(17)  # dies as a killed process would: no clean-up, no message
    if fault["mode"] == "hang":  # tests time the detection from this line
        print(f"acco: test fault: rank {rank} hangs after update {step}", file=sys.stderr, flush=True)
        threading.Event().wait()  # stalls forever, holding its sockets open


def _with_fault_injection(loss_fn, rank: int):
    fault = _fault()
    if fault is None or fault["mode"] != "nan" or fault["rank"] != rank:
        return loss_fn
    calls = {"n": 0}

    def poisoned(model, batch):
        loss, weight = loss_fn(model, batch)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > fault["step"] else loss), weight

    return poisoned


class DecoupledTrainer:
    def __init__(
        self,
        model,
        tokenizer=None,
        train_dataset=None,
        eval_dataset=None,
        text_column_name: str = "text",
        args: Any = None,
        processing_class=None,
        data_collator=None,
    ):
        self.args = TrainArgs.from_any(args)
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.text_column_name = text_column_name
        self.data_collator = data_collator
        self.rank, self.world_size, self.local_rank, self.device = init_distributed(self.args.timeout_s)
        torch.manual_seed(self.args.seed)
        self.model = model.to(self.device)
        self.engine = None
        self.train_data = self._prepare(train_dataset) if train_dataset is not None else None
        if eval_dataset is not None:
            try:
                self.eval_data = self._prepare(eval_dataset)
            except DataError as e:
                raise DataError(f"the eval set: {e} (give more eval data, raise train.eval_fraction "
                                "or set train.eval=false)") from e
        elif self.train_data is not None and self.args.eval:
            train_idx, eval_idx = split_train_eval(len(self.train_data), self.args.eval_fraction, self.args.seed)
            self.train_data, self.eval_data = self._select(self.train_data, train_idx), self._select(self.train_data, eval_idx)
        else:
            self.eval_data = None

    # ---- data ---------------------------------------------------------------------------

    def _prepare(self, dataset):
        """What the streams read: `Rows` of packed blocks (text), masked prompts (instructions)
        or padded token ids (pre-tokenized); with a data collator, the examples themselves."""
        arrays = torch.Tensor | np.ndarray
        if isinstance(dataset, Rows | arrays) or (
            isinstance(dataset, Mapping) and all(isinstance(v, arrays) for v in dataset.values())
        ):
            return dataset if isinstance(dataset, Rows) else Rows(dataset)
        if self.data_collator is not None:
            # Examples, read one by one and collated per micro-batch.
            return dataset if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") else list(dataset)
        first = dataset[0] if len(dataset) else None
        if isinstance(first, str):
            return Rows(self._pack(dataset if isinstance(dataset, list) else list(dataset)))
        columns = getattr(dataset, "column_names", None) or (list(first) if isinstance(first, Mapping) else [])
        if self.text_column_name in columns:
            docs = dataset if is_hf_dataset(dataset) else [r[self.text_column_name] for r in dataset]
            return Rows(self._pack(docs))
        if "instruction" in columns and "output" in columns:
            records = list(dataset) if isinstance(dataset, list) else dataset.to_list()
            return Rows(self._instructions(records))
        if "input_ids" in columns:  # pre-tokenized (run_clm.py's output): a tokenizer only pads
            pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
            return Rows(pad_token_ids(dataset, self.args.max_length, pad))
        raise DataError(
            f"dataset has neither a {self.text_column_name!r} column, instruction/output columns nor "
            f"input_ids (has {columns})"
        )

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise DataError("a tokenizer (or processing_class) is needed to tokenize the dataset")
        return self.tokenizer

    def _instructions(self, records: list[dict]) -> dict:
        """Masked instruction examples; with a cache, rank 0 tokenizes them into it while the
        other ranks wait, then they load that file (or tokenize, if they cannot see it)."""
        tokenizer, cache, length = self._need_tokenizer(), self.args.cache_dir or None, self.args.max_length
        if cache is None:
            return tokenize_instructions(records, tokenizer, length)
        examples = after_rank0(lambda: cached_instructions(records, tokenizer, length, cache), key="instructions")
        return examples if examples is not None else cached_instructions(records, tokenizer, length, cache)

    def _pack(self, docs) -> np.ndarray:
        """Packed blocks, memory-mapped: rank 0 tokenizes the corpus into the cache while the other
        ranks wait, then every rank maps the cache file (a rank that cannot see it, its cache
        folder being on another machine's disk, tokenizes for itself)."""
        tokenizer, cache = self._need_tokenizer(), self.args.cache_dir or None
        if cache is None:
            return pack_documents(docs, tokenizer, self.args.max_length, None, self.text_column_name)
        stream = after_rank0(lambda: token_stream(docs, tokenizer, cache, self.text_column_name), key="packing")
        if stream is None:  # not rank 0
            stream = token_stream(docs, tokenizer, cache, self.text_column_name)
        return blocks_of(stream, self.args.max_length)

    def _select(self, data, idx: torch.Tensor):
        """Rows `idx` of `data`, as an index view (no copy)."""
        if isinstance(data, Rows):
            return data.select(idx)
        return torch.utils.data.Subset(data, idx.tolist())

    def _collate(self, examples: list) -> dict:
        batch = dict(self.data_collator(examples))
        if "labels" not in batch:  # a padding-only collator: every real token is a target
            labels = batch["input_ids"].clone()
            if "attention_mask" in batch:
                labels[batch["attention_mask"] == 0] = IGNORE_INDEX
            batch["labels"] = labels
        return batch

    def _stream(self, data, batch_size: int):
        """(this worker's resumable MicroBatchStream, the iterator of its micro-batches)."""
        if isinstance(data, Rows):
            stream = MicroBatchStream(data, batch_size, self.rank, self.world_size, self.args.seed)
            return stream, stream
        index = MicroBatchStream(torch.arange(len(data)), batch_size, self.rank, self.world_size, self.args.seed)
        return index, (self._collate([data[i] for i in b["input_ids"].tolist()]) for b in index)

    # ---- training -------------------------------------------------------------------------

    @progress.names_lost_ranks
    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict:
        """Train to the budget; `resume_from_checkpoint` (a checkpoint folder, or "latest" / True for
        the newest in output_dir; default train.resume_from_checkpoint) continues a run exactly on
        the same world size, or from the same samples on another one."""
        args = self.args
        if self.train_data is None:
            raise DataError("DecoupledTrainer.train() needs a train_dataset")
        # Ranks may finish their own setup (tokenizing, building the model) far apart: wait for
        # all of them on the store, as the collective timeout is meant for stalls in training.
        every_rank_at("setup")
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        folder = meta = None
        if resume_from_checkpoint:  # True means "latest" (transformers.Trainer's convention)
            folder = checkpoint.resolve(resume_from_checkpoint, args.output_dir)
            meta = checkpoint.load_meta(folder)
            done = checkpoint.already_completed(folder, meta, args.nb_steps_tot)
            if done:  # checked before anything is written: the finished run stays as it is
                if self.rank == 0:
                    print(done, flush=True)
                return {"method": args.method_name, "world_size": self.world_size, "step": int(meta["step"]),
                        "samples": int(meta["samples"]), "nothing_to_do": True}  # fmt: skip
            same_world = int(meta["world_size"]) == self.world_size
            changed = checkpoint.data_changes(meta.get("train") or {}, dataclasses.asdict(args), same_world)
            if changed:  # also before anything is written
                raise checkpoint.CheckpointError(f"{folder}: cannot resume with {', '.join(changed)}: other samples would be read")
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if folder is None:
            self._clear_old_checkpoints(out)
        position, batches = self._stream(self.train_data, args.batch_size)
        self.model.train()
        # The log (TensorBoard's import takes seconds on rank 0) exists before the engine, and
        # every rank starts the clock together: no rank computes while another is still setting up.
        resumed_step = int(meta["step"]) if folder is not None else None
        log = RunLog(str(out), self.rank, self.world_size, args.batch_size * args.max_length, args.log_step, resumed_step)
        self.engine = build_engine(self.model, args.engine_config())
        if folder is not None:
            self._resume(folder, meta, position)
        loss_fn = _with_fault_injection(causal_lm_loss, self.rank)
        stream = _OnDevice(iter(batches), self.device, args.slowdown)
        log.start_progress(args.nb_steps_tot, self.engine.samples)
        every_rank_at("start")
        last = summary = None
        try:
            for record in self.engine.run(stream, loss_fn):
                log.update(record)
                last = record
                if not math.isfinite(record.loss):
                    raise FloatingPointError(f"training loss is {record.loss} at update {record.step}; stopping")
                if args.eval and self.eval_data is not None and record.step % args.eval_step == 0:
                    log.evaluation(record.step, record.samples, self.evaluate()["eval_loss"])
                if args.save_step and record.step % args.save_step == 0:
                    self._checkpoint(record, position)
                _inject_fault_after(record.step, self.rank)
            if last is not None:
                if args.eval and self.eval_data is not None and last.step % args.eval_step != 0:
                    log.evaluation(last.step, last.samples, self.evaluate()["eval_loss"])
                if args.save and not (args.save_step and last.step % args.save_step == 0):
                    self._checkpoint(last, position)
            summary = log.summary(args.method_name, self.device, self._utilisation(log))
        finally:
            self.engine.close()
            log.close(summary)
        if args.save:
            self.save_model(str(out / "model"))
        return summary

    def _clear_old_checkpoints(self, out: Path) -> None:
        """A fresh run must not leave another run's checkpoints for `latest` to pick up."""
        old = sorted(out.glob("checkpoint-*"))
        if old and not self.args.overwrite_output_dir:
            raise checkpoint.CheckpointError(
                f"{out} holds checkpoints of another run ({old[-1].name}); set train.resume_from_checkpoint "
                "to continue it or train.overwrite_output_dir=true to start afresh"
            )
        if self.world_size > 1:
            dist.barrier()  # every rank has looked before rank 0 deletes
        if self.rank == 0:
            for folder in old:
                shutil.rmtree(folder, ignore_errors=True)

    def _utilisation(self, log: RunLog) -> dict:
        """FLOPs per token and, on a GPU whose bf16 peak we know, MFU (as nanoGPT reports it)."""
        if not hasattr(self.model, "config") or not log.records:
            return {}
        from acco.models import flops_per_token

        per_token = flops_per_token(self.model, self.args.max_length)
        tokens_per_s = log.records[-1].samples * log.tokens_per_micro_batch / max(log.records[-1].wall_time, 1e-9)
        peak = _peak_flops(self.device)
        per_worker = per_token * tokens_per_s / self.world_size
        return {"flops_per_token": per_token, "mfu": per_worker / peak if peak else None}

    def _checkpoint(self, record, position) -> Path:
        progress.mark(f"the checkpoint of update {record.step}")  # names a rank that misses it
        state = self.engine.state_dict()
        # Every floating tensor (master, moments, parameters, acco's accumulator and its stats,
        # torch-ddp's optimizer state ...) of every worker, one all-reduced flag: a checkpoint
        # never holds NaN or inf, the last good one stays the newest.
        bad = checkpoint.non_finite(state, self.device, self.world_size)
        if bad:
            raise FloatingPointError(
                f"the training state holds NaN or inf at update {record.step} (rank {self.rank}: "
                f"{', '.join(bad[:6])}); no checkpoint written"
            )
        data = position.state_dict()
        if state.get("fetched_ahead"):  # torch-ddp has read the next update's micro-batches
            data = checkpoint.rewind(data, state["fetched_ahead"])
        worker = {"engine": state, "data": data, "rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            worker["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        meta = {
            "step": record.step,
            "samples": record.samples,
            "method": self.args.method_name,
            "world_size": self.world_size,
            "numel": state["numel"],
            "wall_time": record.wall_time,
            "train": dataclasses.asdict(self.args),
        }
        return checkpoint.save(
            self.args.output_dir, record.step, worker, meta, self.rank, self.world_size,
            self._write_model, self.args.save_total_limit,
        )  # fmt: skip

    def _resume(self, folder: Path, meta: dict, position) -> None:
        old_world = int(meta["world_size"])
        same_world = old_world == self.world_size
        mine = checkpoint.load_worker(folder, self.rank if same_world else 0, old_world)

        def every_worker() -> list[dict]:
            return [checkpoint.load_worker(folder, r, old_world) for r in range(old_world)]

        old_states = None if same_world else every_worker()
        exact = self.engine.load_state_dict(mine["engine"], lambda: [s["engine"] for s in old_states])
        if exact:
            position.load_state_dict(mine["data"])
            torch.set_rng_state(mine["rng"])
            if self.device.type == "cuda" and "cuda_rng" in mine:
                torch.cuda.set_rng_state(mine["cuda_rng"], self.device)
        else:
            position.load_state_dict(
                checkpoint.data_position(old_states, self.args.batch_size, self.world_size, position.batches_per_epoch)
            )
        if self.rank == 0:
            for change in checkpoint.config_changes(meta.get("train") or {}, dataclasses.asdict(self.args)):
                print(f"acco: warning: {change}", file=sys.stderr, flush=True)
            how = "exactly" if exact else f"from {old_world} workers, resharded to {self.world_size}"
            print(f"resuming {how} from {folder} (update {meta['step']}, {meta['samples']} micro-batches)", flush=True)

    @progress.names_lost_ranks
    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict:
        """Mean next-token loss over the eval set, split across workers: {"eval_loss", "eval_perplexity"}."""
        data = self._prepare(eval_dataset) if eval_dataset is not None else self.eval_data
        if data is None:
            raise DataError("no eval_dataset to evaluate on")
        batch_size = self.args.eval_batch_size or self.args.batch_size
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        committed = self.engine.committed_params() if self.engine is not None else contextlib.nullcontext()
        was_training = self.model.training
        self.model.eval()
        with committed:
            collate = None if isinstance(data, Rows) else self._collate
            for i, batch in enumerate(eval_batches(data, batch_size, self.rank, self.world_size, collate)):
                if self.args.max_eval_batches is not None and i >= self.args.max_eval_batches:
                    break
                batch = {k: v.to(self.device) for k, v in batch.items()}
                loss_sum, tokens = causal_lm_loss(self.model, batch)
                totals[0] += loss_sum
                totals[1] += tokens
        self.model.train(was_training)
        if self.world_size > 1:
            progress.mark(f"the evaluation after update {self.engine.step if self.engine else 0}")
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1]).item()
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}

    def save_model(self, output_dir: str | None = None) -> None:
        """save_pretrained form (safetensors), reloadable with AutoModelForCausalLM.from_pretrained."""
        folder = Path(output_dir or Path(self.args.output_dir) / "model")
        after_rank0(lambda: self._write_model(folder), key=f"model/{folder.resolve()}")

    def _write_model(self, output_dir) -> None:
        committed = self.engine.committed_params() if self.engine is not None else contextlib.nullcontext()
        with committed:
            # The parameters are views of one flat buffer: hand save_pretrained its own tensors,
            # one per storage so that tied weights stay tied.
            copies: dict[int, torch.Tensor] = {}
            state = {k: copies.setdefault(v.data_ptr(), v.detach().clone()) for k, v in self.model.state_dict().items()}
        self.model.save_pretrained(str(output_dir), state_dict=state, safe_serialization=True)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(output_dir))
