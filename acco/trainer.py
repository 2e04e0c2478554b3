"""DecoupledTrainer: transformers.Trainer's shape (model, tokenizer, datasets; train, evaluate,
save_model) with acco's train keys for its args, training with acco (or a baseline).

    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer,
                               train_dataset=ds["train"], eval_dataset=ds["validation"],
                               text_column_name="text", args={"method": "acco", "nb_steps_tot": 4000})
    trainer.train()

`args` holds acco's train keys (``method`` or the seed's ``method_name`` for the method); those it
leaves out are the command line's for that method (``acco.config.train_defaults``).

The loop is thin: it turns the datasets into per-worker micro-batch streams, hands the engine a
loss function, and around the engine's updates it logs, evaluates and saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from acco import checkpoint
from acco.checkpoint_writer import CheckpointWriter
from acco.config import TrainArgs
from acco.data.errors import DataError
from acco.data.loader import Rows, eval_batch_count, eval_batches, split_train_eval
from acco.data.on_device import OnDevice, Rewound, check_token_ids, without_full_mask
from acco.data.prepare import collate, forward_fields, micro_batches, prepare_dataset, select
from acco.engine import build_engine, progress
from acco.engine.device import device_ops
from acco.engine.full_state import forwards_in_lockstep, full_state_dict
from acco.engine.layout import layout_words
from acco.launch import preemption
from acco.launch.process_group import after_rank0, decided_by_rank0, every_rank_at, init_distributed
from acco.loss import causal_lm_loss, loss_note
from acco.metrics import RunLog
from acco.models import check_fits, checkpoint_activations, token_rows
from acco.resume import ResumePoint, config_changes, decide_resume, say_skipped

__all__ = ["DecoupledTrainer", "TrainArgs", "causal_lm_loss"]


# Dense bf16 peaks (FLOP/s) of common accelerators, by a substring of their name.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def _peak_flops(device: torch.device) -> float | None:
    name = device_ops(device).name()
    return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)


def _not_exact(engine) -> str | None:
    """Why a resume on the same world size does not follow the uninterrupted run update for update
    (None: it does)."""
    cfg = engine.cfg
    if not cfg.fixed_batch:
        cap = cfg.accumulate_cap
        grows = f"grow to {cfg.most_micro_batches(cfg.n_grad_accumulation)}" if cap else "grow without bound"
        return (
            f"micro-batches per round follow timing here (train.accumulate_cap={cap} lets a round's "
            f"train.n_grad_accumulation={cfg.n_grad_accumulation} {grows}), so later updates differ from "
            "an uninterrupted run's; train.accumulate_while_waiting=false gives a fixed batch and an exact "
            "resume"
        )
    recomputed = getattr(engine, "recomputed_micro_batches", 0)
    if recomputed:
        return (
            f"the checkpoint holds no accumulated gradients (its batch followed timing), so this worker's "
            f"{recomputed} pending micro-batch(es) are computed again at the committed parameters"
        )
    return None


def _resharded(meta: dict, world_size: int, order: int, where: str) -> str:
    """The line of a resharded resume; with the shard orders (meta.json's workers_per_node, this
    engine's) where either is the two-level rounds'."""
    old_world, old = int(meta["world_size"]), int(meta.get("workers_per_node", 0))

    def order_of(world: int, per_node: int) -> str:
        if not old and not order:
            return ""
        return f" ({layout_words(world, per_node)}' shard order)" if per_node else " (flat shard order)"

    return (f"resuming from {old_world} workers{order_of(old_world, old)}, resharded to {world_size}"
            f"{order_of(world_size, order)} {where}")


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
        *,
        process: tuple | None = None,
        seeded: bool = False,
        inputs_checked: bool = False,
        on_train_start: Callable[[], None] | None = None,
    ):
        """What the caller already did is passed here, so that each is done once per process:
        `process`, its ``init_distributed()``'s ``(rank, world_size, local_rank, device)`` (None: the
        trainer joins the group); `seeded`, torch's seed set to train.seed before the model was built
        (False: the trainer sets it); `inputs_checked`, the run folder checked by the job's
        validation pass (False: checked in `train`, by the same ``check_output_dir``).
        `on_train_start`: rank 0 calls it once training is about to start, a resume having
        succeeded (the command line writes the run's config.yaml then: a run that cannot start
        leaves the folder as it was)."""
        self.args = TrainArgs.from_any(args)
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        self.text_column_name = text_column_name
        self.data_collator = data_collator
        vocab = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None  # None: no tokenizer
        check_fits(model, vocab, self.args.max_length)
        process = process if process is not None else init_distributed(self.args.timeout_s)
        self.rank, self.world_size, self.local_rank, self.device = process
        if not seeded:
            torch.manual_seed(self.args.seed)
        self.model = model.to(self.device)
        if self.rank == 0 and (note := loss_note(model)) is not None:  # right, but slower than the fused loss
            print(note, flush=True)
        if self.args.gradient_checkpointing:  # activations recomputed layer by layer in the backward pass
            checkpoint_activations(model)
        self.engine = None
        self._on_train_start, self._inputs_checked = on_train_start, inputs_checked
        self._collator_fields = forward_fields(model) if self.args.remove_unused_columns else None
        self.train_data = self._prepare(train_dataset) if train_dataset is not None else None
        if eval_dataset is not None:
            try:
                self.eval_data = self._prepare(eval_dataset)
            except DataError as e:
                raise DataError(f"the eval set: {e} (give more eval data, raise train.eval_fraction "
                                "or set train.eval=false)") from e
        elif self.train_data is not None and self.args.eval:
            train_idx, eval_idx = split_train_eval(
                len(self.train_data), self.args.eval_fraction, self.args.seed
            )
            self.train_data, self.eval_data = (
                select(self.train_data, train_idx),
                select(self.train_data, eval_idx),
            )
        else:
            self.eval_data = None

    def _prepare(self, dataset):
        return prepare_dataset(
            dataset,
            tokenizer=self.tokenizer,
            max_length=self.args.max_length,
            cache_dir=self.args.cache_dir or None,
            text_column=self.text_column_name,
            data_collator=self.data_collator,
        )

    # ---- training -------------------------------------------------------------------------

    @progress.names_lost_ranks
    def train(self, resume_from_checkpoint: str | bool | ResumePoint | None = None) -> dict:
        """Train to the budget; `resume_from_checkpoint` (a checkpoint folder, or "latest" / True for
        the newest in output_dir that verifies, or "auto": that one if any, else from scratch;
        default train.resume_from_checkpoint; acco.resume decides) continues a run exactly on the
        same world size, or from the same samples on another one. On a signal of
        train.save_on_signal every worker stops after the same update and checkpoints it; the
        summary then says `stopped_on_signal`."""
        args = self.args
        if self.train_data is None:
            raise DataError("DecoupledTrainer.train() needs a train_dataset")
        # Ranks may finish their own setup (tokenizing, building the model) far apart: wait for
        # all of them on the store, as the collective timeout is meant for stalls in training.
        every_rank_at("setup")
        if resume_from_checkpoint is None:
            resume_from_checkpoint = args.resume_from_checkpoint
        point = self._resume_point(resume_from_checkpoint)
        folder, meta = point.folder, point.meta
        if point.completed:  # checked before anything is written: the finished run stays as it is
            if self.rank == 0:
                print(point.completed, flush=True)
            return {
                "method": args.method_name,
                "world_size": self.world_size,
                "step": int(meta["step"]),
                "samples": int(meta["samples"]),
                "nothing_to_do": True,
            }
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if folder is None:
            self._clear_old_checkpoints(out)
        position, batches = micro_batches(
            self.train_data, args.batch_size, self.rank, self.world_size, args.seed, self.data_collator,
            self._collator_fields,
        )
        self.model.train()
        self.engine = build_engine(self.model, args.engine_config())
        rounds = getattr(self.engine, "rounds", None)  # the layout its rounds run on (engine/nodes.py)
        if self.rank == 0 and self.world_size > 1 and rounds is not None:
            print(f"layout: {rounds.note}", flush=True)
        self._writer, self._checkpoint_pause_s = CheckpointWriter(self.device, args.async_save), 0.0
        summary = log = None
        # A preemption notice from here on stops the run after an update, checkpointed
        # (launch/preemption.py); one that comes after the last update lets the run finish.
        with preemption.save_on_signals(args.save_on_signal, self.engine.request_stop) as caught:
            try:
                if folder is not None:
                    self._resume(folder, meta, position)
                # Only now is anything written: a checkpoint this run cannot continue leaves the run
                # folder as it was (the log cuts metrics.jsonl back to the checkpoint's update). Rank
                # 0's log imports TensorBoard (seconds): the "start" barrier in _run waits for it, and
                # every rank starts the clock together.
                log = RunLog(str(out), self.rank, self.world_size, args.batch_size * args.max_length,
                             args.log_step, int(meta["step"]) if folder is not None else None)  # fmt: skip
                if self._on_train_start is not None and self.rank == 0:
                    self._on_train_start()
                summary = self._run(log, batches, position, caught)
            finally:
                self._writer.close(timeout_s=2 * args.timeout_s)  # after a failure: what can still land
                self.engine.close()
                if log is not None:
                    log.close(summary)
            if args.save and "stopped_on_signal" not in summary:
                self.save_model(str(out / "model"))
        return summary

    def _run(self, log: RunLog, batches, position, caught: list[str]) -> dict:
        """The engine's updates to the end of the run (or a stop), the final evaluation and
        checkpoint, and the run's summary."""
        args = self.args
        stream = self._stream = OnDevice(
            iter(batches), self.device, args.slowdown, vocab_size=token_rows(self.model)
        )
        log.start_progress(args.nb_steps_tot, self.engine.committed_micro_batches, self.engine.sync_note())
        every_rank_at("start")
        records = self.engine.run(stream, causal_lm_loss)
        last, stopped, on_signal = self._updates(records, stream, log, position)
        # Every rank, also after a stop: nothing in flight and the model at the committed
        # parameters before anything rank 0 does alone (the final save) touches it.
        records.close()
        self.engine.finish()
        if last is not None and not on_signal:
            if args.eval and self.eval_data is not None and last.step % args.eval_step != 0:
                self._evaluate_and_log(log, last)
            if args.save and not (args.save_step and last.step % args.save_step == 0):
                self._checkpoint(last, position, log)
        self._writer.wait()  # the last checkpoint is whole before the run reports or exits
        facts = {**self._utilisation(log), **self._run_facts(stopped)}
        if on_signal:  # this worker's signal, or a peer's that reached it with the statistics
            facts.update(
                stopped_on_signal=caught[0] if caught else "a peer's signal", stopped_at_update=last.step
            )
        return log.summary(args.method_name, self.device, facts)

    def _updates(self, records, stream: OnDevice, log: RunLog, position):
        """Log each update, evaluate and checkpoint on schedule; stop at train.stop_at_eval_loss
        or on a signal. Returns the last update's record, whether the eval loss stopped the run,
        and whether a signal did."""
        args = self.args
        last, stopped, on_signal = None, False, False
        for record in records:
            log.update(record)
            last = record
            if not math.isfinite(record.loss):
                raise FloatingPointError(f"training loss is {record.loss} at update {record.step}; stopping")
            with stream.not_compute():  # a slowdown stretches micro-batches, not these
                if args.eval and self.eval_data is not None and record.step % args.eval_step == 0:
                    stopped = self._evaluate_and_log(log, record)
                # Every worker's record of the same update says stop: all checkpoint it and leave.
                on_signal = record.stop and record.committed_micro_batches < args.nb_steps_tot
                if (args.save_step and record.step % args.save_step == 0) or on_signal:
                    self._checkpoint(record, position, log)
            if stopped or on_signal:
                break
        return last, stopped, on_signal

    def _evaluate_and_log(self, log: RunLog, record) -> bool:
        """Evaluate and log the loss with the evaluation's own seconds (training time excludes
        them); True when train.stop_at_eval_loss is reached (the loss is all-reduced: every rank
        decides alike). The update's own line comes first, if log_step left it out."""
        log.print_pending()
        self.engine.quiesce()  # no collective of ours while one of the engine's may be in flight
        if self.world_size > 1:
            # Overlapped methods' ranks leave a round up to a micro-batch apart: the wait for the
            # last one counts as training time, the evaluation's seconds start when all are here.
            dist.barrier()
        start = time.perf_counter()
        loss = self.evaluate()["eval_loss"]
        log.evaluation(record.step, record.committed_micro_batches, loss, eval_s=time.perf_counter() - start,
                       sync_note=self.engine.sync_note())
        return self.args.stop_at_eval_loss is not None and loss <= self.args.stop_at_eval_loss

    def _run_facts(self, stopped: bool) -> dict:
        """For summary.json: whether the run stopped at train.stop_at_eval_loss, and the bytes the
        engine holds on this worker (every engine reports them)."""
        facts = {
            "state_bytes": int(sum(self.engine.state_bytes().values())),
            "checkpoint_pause_s": round(self._checkpoint_pause_s, 3),
        }
        if self.args.stop_at_eval_loss is not None:
            facts["stopped_at_eval_loss"] = stopped
        return facts

    def _resume_point(self, spec) -> ResumePoint:
        """Whether and from where this run resumes: acco.resume.decide_resume's answer, taken as it
        is when the job's validation pass made it (the command line hands its ResumePoint), else
        made here once, on rank 0, with the run folder's check (a finished run is not overwritten):
        the CRC check reads every worker's file. Every rank follows rank 0's verdict."""
        if isinstance(spec, ResumePoint):
            return spec
        from acco.config import InputError
        from acco.models import count_parameters
        from acco.validate import check_output_dir

        args = dataclasses.replace(self.args, resume_from_checkpoint=spec)
        errors = {"InputError": InputError, "CheckpointError": checkpoint.CheckpointError}

        def verdict() -> str:
            try:
                if not self._inputs_checked:
                    check_output_dir(args.output_dir, args.overwrite_output_dir, args.resume_from_checkpoint)
                numel = count_parameters(self.model, trainable_only=True)
                point = decide_resume(args, self.world_size, lambda _: numel)
            except tuple(errors.values()) as e:
                return f"{type(e).__name__} {e}"
            say_skipped(point)
            return f"ok {point.to_json()}"

        kind, _, line = decided_by_rank0(verdict, key="resume").partition(" ")
        if kind != "ok":
            raise errors[kind](line)
        return ResumePoint.from_json(line)

    def _clear_old_checkpoints(self, out: Path) -> None:
        """A fresh run must not leave another run's checkpoints for `latest` to pick up."""
        old = sorted(out.glob("checkpoint-*"))
        # A save that crashed leaves only its .tmp folder: debris, not a run to protect (with
        # resume auto, a job killed in its first save must start afresh on its restart).
        kept = [p for p in old if not p.name.endswith(".tmp")]
        if kept and not self.args.overwrite_output_dir:
            raise checkpoint.CheckpointError(
                f"{out} holds checkpoints of another run ({kept[-1].name}); set train.resume_from_checkpoint "
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
        last = log.records[-1]
        tokens_per_s = last.committed_micro_batches * log.tokens_per_micro_batch / max(last.wall_time, 1e-9)
        peak = _peak_flops(self.device)
        per_worker = per_token * tokens_per_s / self.world_size
        return {"flops_per_token": per_token, "mfu": per_worker / peak if peak else None}

    def _checkpoint(self, record, position, log: RunLog) -> None:
        """Checkpoint `record`'s update; training goes on while it is written (train.async_save).
        The update's own line comes first, if log_step left it out."""
        log.print_pending()
        start = time.perf_counter()
        self.engine.quiesce()
        progress.mark(f"the checkpoint of update {record.step}")  # names a rank that misses it
        # Every rank enters committed_params here: for wp it all-gathers the committed parameters
        # from the master shards (a collective); sharded inside the node, every rank gathers the model.
        stream = getattr(self, "_stream", None)
        if stream is not None and stream.ahead:  # the prefetched micro-batch is read again on resume
            position = Rewound(position, stream.ahead)
        with self.engine.committed_params():
            checkpoint.save_run(
                self.engine,
                position,
                record,
                dataclasses.asdict(self.args),
                self.rank,
                self.world_size,
                self._writer,
                self._model_snapshot,
            )
        self._checkpoint_pause_s += time.perf_counter() - start

    def _resume(self, folder: Path, meta: dict, position) -> None:
        exact = checkpoint.resume_run(
            self.engine, position, folder, meta, self.rank, self.world_size, self.device, self.args.batch_size
        )
        if self.rank == 0:
            for change in config_changes(meta.get("train") or {}, dataclasses.asdict(self.args)):
                print(f"acco: warning: {change}", file=sys.stderr, flush=True)
            where = f"from {folder} (update {meta['step']}, {meta['samples']} micro-batches)"
            if not exact:
                order = checkpoint.shard_order(self.engine)
                print(_resharded(meta, self.world_size, order, where), flush=True)
            else:
                why = _not_exact(self.engine)
                line = f"resuming {where}, not exactly: {why}" if why else f"resuming exactly {where}"
                print(line, flush=True)

    @progress.names_lost_ranks
    @torch.no_grad()
    def evaluate(self, eval_dataset=None) -> dict:
        """Mean next-token loss over the eval set, split across workers: {"eval_loss", "eval_perplexity"}."""
        data = self._prepare(eval_dataset) if eval_dataset is not None else self.eval_data
        if data is None:
            raise DataError("no eval_dataset to evaluate on")
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.engine is not None:
            self.engine.quiesce()  # before the all-reduces below
        committed = self.engine.committed_params() if self.engine is not None else contextlib.nullcontext()
        # Training's precision context (torch-ddp: fp32 parameters under bf16 autocast). Before
        # train() no engine has cast the parameters to the training dtype yet (they are in their
        # load dtype): bf16 autocast in mixed precision, as torch-ddp trains (flash_attention_2,
        # chosen at build time for mixed precision on CUDA, refuses fp32 inputs).
        if self.engine is not None:
            precision = self.engine.compute_context()
        elif self.args.use_mixed_precision:
            precision = torch.autocast(self.device.type, dtype=torch.bfloat16)
        else:
            precision = contextlib.nullcontext()
        was_training = self.model.training
        self.model.eval()
        with committed, precision:
            self._evaluate_into(totals, data)
        self.model.train(was_training)
        if self.world_size > 1:
            progress.mark(f"the evaluation after update {self._updates_so_far()}")
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1]).item()
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}

    def _updates_so_far(self) -> int:
        return self.engine.step if self.engine else 0

    def _evaluate_into(self, totals: torch.Tensor, data) -> None:
        """Add this worker's share of the eval set to `totals` (summed token losses, target tokens).
        Sharded inside the node, a forward all-gathers each block over the node's workers: every
        worker runs as many forwards as the most loaded one, those past its own batches on the eval
        set's first batch (a shape compiled blocks have seen), their loss not counted."""
        batch_size = self.args.eval_batch_size or self.args.batch_size
        collate_fn = (
            None
            if isinstance(data, Rows)
            else (lambda examples: collate(self.data_collator, examples, self._collator_fields))
        )
        rows = token_rows(self.model)
        batches = eval_batches(data, batch_size, self.rank, self.world_size, collate_fn)
        mine = eval_batch_count(len(data), batch_size, self.rank, self.world_size, self.args.max_eval_batches)
        forwards = mine
        if self.world_size > 1 and forwards_in_lockstep(self.model):
            most = torch.tensor([mine], dtype=torch.int64, device=self.device)
            progress.mark(f"the evaluation's batch count after update {self._updates_so_far()}")
            dist.all_reduce(most, op=dist.ReduceOp.MAX)  # main thread, no round in flight: quiesced
            forwards = int(most.item())
        for i in range(forwards):
            counted = i < mine
            batch = next(batches) if counted else next(eval_batches(data, batch_size, 0, 1, collate_fn))
            check_token_ids(batch, rows)
            batch = {k: v.to(self.device) for k, v in without_full_mask(batch).items()}
            loss_sum, tokens = causal_lm_loss(self.model, batch)
            if counted:
                totals[0] += loss_sum
                totals[1] += tokens

    def save_model(self, output_dir: str | None = None) -> None:
        """save_pretrained form (safetensors), reloadable with AutoModelForCausalLM.from_pretrained.
        Every worker calls it: a model sharded inside the node is gathered by all of them."""
        folder = Path(output_dir or Path(self.args.output_dir) / "model")
        write = self._model_snapshot()
        after_rank0(lambda: write(folder), key=f"model/{folder.resolve()}")

    def _model_snapshot(self, writer: CheckpointWriter | None = None):
        """The committed model copied to rank 0's host memory now (into `writer`'s buffers when it
        writes in the background); returns the call that writes that copy in save_pretrained form
        (None on the other ranks). Every rank calls it: a model sharded inside the node is gathered
        tensor by tensor by all the node's workers (acco/engine/full_state.py)."""
        committed = self.engine.committed_params() if self.engine is not None else contextlib.nullcontext()
        copy = None
        if self.rank == 0:  # the parameters are views of one flat buffer (or DTensor shards): hand
            # save_pretrained host tensors of its own, one per storage so that tied weights stay tied
            copy = ((lambda v, k: writer.host_copy(v, f"model.{k}")) if writer
                    else (lambda v, k: v.to("cpu", copy=True)))  # fmt: skip
        with committed:
            state = full_state_dict(self.model, copy)
        if copy is None:
            return None

        def write(output_dir) -> None:
            self.model.save_pretrained(str(output_dir), state_dict=state, safe_serialization=True)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(output_dir))

        return write
