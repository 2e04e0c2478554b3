"""`python main.py train=acco ...` and `acco-train ...`: Hydra config in, a trained model out.

The path of a job, in the order it runs:

1. ``main``: the config is composed once, from acco/conf and the schema in acco/config.py (a
   worker of the local launcher composes nothing: it is handed its job, step 2).
2. ``run``: ``process_role`` decides, in one place, what this process is (``Role``):

   - a plain ``python main.py`` with ``launch.nproc`` > 1 is the local launcher
     (acco/launch/local.py): it runs the job's checks that cost nothing (``check_at_once``: the
     folders, the data's path, ...; a refused run starts no worker), starts that many workers
     of the same command and, while they import torch, runs the rest of the job's one
     validation pass (``validated``, acco/validate.py);
     then it hands each worker the validated ``Job`` (acco/job.py) through its start gate;
   - such a worker (``Role.LAUNCHED``) waits at its gate for that job and validates nothing;
   - under torchrun or srun, and a plain ``python main.py`` with one worker (``Role.WORKER``),
     rank 0 validates while the others wait on the store, and rank 0 starts from what the
     pass loaded.
3. ``train_worker``: the worker prepares its data in one call (``acco.data.prepare.prepare_data``:
   the tokenizer and the ready train and eval rows), builds the model (acco/models.py) and hands
   both to ``DecoupledTrainer`` (acco/trainer.py), whose engine (acco/engine) runs the comm rounds.
"""

from __future__ import annotations

import atexit
import enum
import gc
import logging
import os
import pickle
import signal
import sys
import threading
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from acco.config import (
    EXIT_SAVED_ON_SIGNAL,
    AlreadyCompleted,
    InputError,
    check_values,
    compose,
    one_line_error,
)
from acco.data.errors import DataError
from acco.engine.config import ConfigWarning, advised, take_as_advised
from acco.engine.progress import FAILURE_DIR_ENV, launcher_is_stopping
from acco.job import Job, job_of
from acco.launch.env import dist_env, self_command
from acco.launch.local import SAVE_SIGNALS_ENV, handed_job, launch_local, local_nproc, wait_for_go
from acco.launch.preemption import catch_early, stop_catching_early


class Role(enum.Enum):
    LAUNCHER = "launcher"  # a plain python main.py with several local workers: starts and watches them
    LAUNCHED = "launched"  # a worker of that launcher: handed the validated job, validates nothing
    WORKER = "worker"  # under torchrun or srun, or the one worker of a plain python main.py


# A Ctrl-C's line: said once, by the local launcher if there is one
INTERRUPTED = "acco: interrupted; Ctrl-C saves nothing (a SIGTERM checkpoints first: train.save_on_signal)\n"


HYDRA_FLAGS = {"-h", "--help", "-hc", "--hydra-help", "--version", "-c", "--cfg", "--resolve", "-p",
               "--package", "-i", "--info", "-r", "--run", "-m", "--multirun", "-sc", "--shell-completion",
               "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun"}


def entry() -> None:
    """The command line's entry point (``acco-train``, ``python -m acco.cli``, main.py): `main`,
    then, after a run that ended its own way, out without Python's finalization. A worker that
    imported torch and transformers spends about 2 s on this 2-core VM tearing their modules down,
    and a job waits for its slowest worker (BENCHMARKS-history.md, "From the test suite"). Only
    the process's own exit is skipped: its other threads finish and its atexit hooks run (logging's
    flush, the heartbeat's stop) as at a normal exit. `main` itself, which tests call in process,
    exits as any function does."""
    try:
        main()
        code = 0
    except SystemExit as e:  # main's own exits carry an int; another (a message) is Python's to say
        if not (e.code is None or isinstance(e.code, int)):
            raise
        code = e.code or 0
    if code not in (0, EXIT_SAVED_ON_SIGNAL):
        # A failed rank 0 hosts the rendezvous store, which its peers may be reading: gone at
        # once, it would cut them off mid-read (a C++ trace and a second error line, seen on a
        # 2-core VM), where a normal exit gives them the moments to say their own error first.
        # A run that ended its own way has left the store in order (leave_the_store).
        sys.exit(code)
    exit_without_finalizing(code)


def exit_without_finalizing(code: int) -> None:
    """What a normal exit does that a run's outputs can depend on, then ``os._exit(code)``: the
    interpreter's own first step (threading's exit hooks, which stop library thread pools, then
    every other non-daemon thread joined), the atexit hooks, and the standard streams flushed.
    acco's background checkpoint write is a daemon (a write stuck after a failure must not hold
    the exit): the trainer waits for it before it returns, so a run's last checkpoint is on disk
    before this starts."""
    # CPython's own calls at exit, in its order (there is no public one). Joining the threads
    # without the hooks waited forever on pools that only their hook stops: concurrent.futures'
    # idle workers, inductor's compile pool among them (a compiled run never exited).
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass
    os._exit(code)


def main() -> None:
    argv = sys.argv[1:]
    warnings.showwarning = _one_line_warnings(warnings.showwarning)
    if handed_job():  # a local launcher's worker: its forwarded notices are noted from here on
        catch_early([name for name in os.environ.get(SAVE_SIGNALS_ENV, "").split(",") if name])
    # acco's own progress notes (caches found, examples dropped) on stdout, as print's lines
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("acco").addHandler(handler)
    logging.getLogger("acco").setLevel(logging.INFO)
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (--help, --cfg job, -m ...)
        _refuse_other_flags(argv)
        return _hydra_app()
    debug = os.environ.get("ACCO_DEBUG") or "launch.debug=true" in [a.lower() for a in argv]
    try:  # nested: a Ctrl-C that lands while an error is being reported is still a Ctrl-C
        try:
            cfg = None if handed_job() else compose(argv)  # a launched worker is handed its job instead
            debug = debug or (cfg is not None and cfg.launch.debug)
            code = run(cfg)
        except Exception as e:  # one clear line for the user; launch.debug=true shows the traceback
            if debug:
                raise
            if not launcher_is_stopping():  # else a peer stopped on the launcher's signal first
                _report(e)
            code = 1
    except KeyboardInterrupt:  # Ctrl-C: said once (by the local launcher, if there is one)
        if debug:
            raise
        launched = FAILURE_DIR_ENV in os.environ  # by the local launcher, which says it
        if os.environ.get("RANK") is None or (os.environ["RANK"] == "0" and not launched):
            sys.stderr.write(INTERRUPTED)
        code = 128 + signal.SIGINT
    if code:
        sys.exit(code)


def _refuse_other_flags(argv: list[str]) -> None:
    """`--nproc 4` is not an override: one line naming the key=value meant, not Hydra's usage."""
    for i, arg in enumerate(argv):
        flag = arg.split("=", 1)[0]
        if not arg.startswith("-") or flag in HYDRA_FLAGS:
            continue
        name = flag.lstrip("-").replace("-", "_")
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "...")
        cfg = compose([])
        keys = [f"{g}.{name}" for g in cfg if isinstance(cfg[g], DictConfig) and name in cfg[g]]
        meant = f" (did you mean '{keys[0]}={value}'?)" if keys else ""
        sys.stderr.write(f"acco: error: unknown option {flag!r}{meant}: settings are key=value overrides, "
                         "e.g. launch.nproc=2 train=acco\n")
        sys.exit(2)


def _hydra_app() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def app(cfg: DictConfig) -> None:
        check_values(cfg)  # as compose does: Hydra's composition runs no group's value checks
        code = run(cfg)
        if code:
            sys.exit(code)

    app()


def _one_line_warnings(show):
    """warnings.showwarning for the command line: acco's own configuration warnings as one line
    from rank 0 (not Python's file, line and source of whatever code built the config)."""

    def showwarning(message, category, *args, **kwargs):
        if not issubclass(category, ConfigWarning):
            return show(message, category, *args, **kwargs)
        if _launched_rank() in (None, "0"):  # once per job, also under srun
            sys.stderr.write(f"acco: warning: {message}\n")

    return showwarning


def _report(e: BaseException) -> None:
    rank = _launched_rank()
    where = f"[rank {rank}] " if rank is not None else ""
    # acco's own input errors are worded for the user: no class name in front (as acco-prepare)
    kind = "" if isinstance(e, InputError | DataError) else f"{type(e).__name__}: "
    # one write of the whole text (print writes its newline apart where stderr is unbuffered)
    sys.stderr.write("".join(f"acco: error: {where}{kind}{line}\n" for line in error_lines(e)))
    sys.stderr.flush()


def _launched_rank() -> str | None:
    """This worker's rank as its launcher set it: RANK (torchrun, acco's local launcher), else
    SLURM_PROCID in an srun step; None outside any."""
    if "RANK" in os.environ:
        return os.environ["RANK"]
    try:
        env = dist_env()
    except ValueError:  # a malformed SLURM variable: the run's own check says so
        return None
    return None if env is None else str(env["rank"])


def error_lines(e: BaseException) -> list[str]:
    """What an error says, a line each: the problems of an InputError (acco.validate.check_at_once
    reports several together, one to a line), else the exception's one line."""
    if isinstance(e, InputError):
        return [" ".join(line.split()) for line in str(e).split("\n") if line.strip()] or [type(e).__name__]
    return [one_line_error(e)]


def run(cfg: DictConfig | None) -> int:
    """The job of a composed config (None: a launched worker, handed its job by the launcher)."""
    role, world_size = process_role(cfg)
    env = dist_env()
    quiet_progress_bars(env["rank"] if env else 0)
    if role is Role.LAUNCHER:
        return launch_workers(cfg, world_size)
    return train_worker(cfg, role, world_size)


def process_role(cfg: DictConfig | None) -> tuple[Role, int]:
    """What this process is, and the job's number of workers: decided here only. `cfg` is read
    for a plain ``python main.py`` alone (launch.nproc); a launched worker has none."""
    env = dist_env()
    if env is not None:
        return (Role.LAUNCHED if handed_job() else Role.WORKER), env["world_size"]
    nproc = local_nproc(cfg.launch.nproc)
    return (Role.WORKER if nproc == 1 else Role.LAUNCHER), nproc


def quiet_progress_bars(rank: int) -> None:
    """datasets' and transformers' own progress bars only on rank 0 in a terminal: in a log file
    their carriage returns make a mess, and every rank would print them."""
    if rank == 0 and sys.stderr.isatty():
        return
    # Environment variables, read when the libraries are imported (not imported here: they cost
    # seconds of start-up).
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's


def launch_workers(cfg: DictConfig, nproc: int) -> int:
    """The local launcher: `nproc` workers of this command, started once the job's folders have
    been checked; they import while this process validates the rest, then each is handed the
    validated job through its start gate.

    The job travels pickled: the workers are separate interpreters (started as torchrun starts
    them, so that a worker is the same process whoever launched it), and nothing but bytes
    crosses into them. They do not compose or parse the config again."""
    from acco.validate import check_at_once

    job = job_of(cfg, nproc)
    # What costs nothing to check first, before any worker starts: a run that would overwrite
    # another, an output_dir that cannot be written, a missing data file are said at once, together,
    # no worker started for nothing.
    check_at_once(job)
    threads = (
        {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": max(1, (os.cpu_count() or 1) // nproc)}
    )
    debug = {"ACCO_DEBUG": "1"} if job.launch.debug else {}

    def check() -> bytes:
        kind, _, line = validated(job).partition(" ")
        if kind == "done":
            raise AlreadyCompleted(line)
        if kind == "error":
            raise InputError(line)
        job.loaded = None  # what the pass loaded stays here: each worker loads its own
        job.advised = advised()  # said here, once: not again by the workers
        return pickle.dumps(job)

    # As torchrun does: workers sharing a machine must not each spin up a thread per core. A
    # preemption notice is forwarded, and the launcher waits while the workers checkpoint.
    save_signals = [signal.Signals[name] for name in job.args.save_on_signal]
    try:
        code = launch_local(
            nproc, self_command(), env_extra={**threads, **debug}, check=check, save_signals=save_signals,
            workers_per_node=job.launch.workers_per_node,
        )
        if code == 128 + signal.SIGINT:  # Ctrl-C, forwarded: said here, the workers say nothing
            sys.stderr.write(INTERRUPTED)
        return code
    except AlreadyCompleted as done:  # the checkpoint to resume has completed the budget
        print(done, flush=True)
        return 0


def validated(job: Job) -> str:
    """The job's one validation pass (acco.validate.check_job), as the word and line every
    process acts on: "ok RESUME" (where the job resumes from: acco.resume.ResumePoint's JSON),
    "done LINE" (the checkpoint to resume has completed the budget) or "error LINE". What the
    pass loaded stays in ``job.loaded``, its resume decision in ``job.resume``."""
    from acco.validate import check_job

    try:
        check_job(job)
    except AlreadyCompleted as done:
        return f"done {done}"
    except Exception as e:
        if job.launch.debug or os.environ.get("ACCO_DEBUG"):
            raise
        return "error " + "\n".join(error_lines(e))
    return f"ok {job.resume.to_json() if job.resume else ''}"


def train_worker(cfg: DictConfig | None, role: Role, world_size: int) -> int:
    """One worker's job: import what training needs (the local launcher validates meanwhile), get
    the job (handed by the launcher, else validated on rank 0 while the others wait), prepare the
    data, build the model, train."""
    import acco.data.prepare  # noqa: F401  (torch, transformers, datasets: imported while the launcher validates)
    import acco.trainer  # noqa: F401
    from acco.host_memory import keep_heap_small

    keep_heap_small()  # freed activations go back to the system (acco/host_memory.py)

    # the launcher's validated job (or a quiet exit if its pass failed), else this config's
    job: Job = pickle.loads(wait_for_go()) if role is Role.LAUNCHED else job_of(cfg, world_size)
    take_as_advised(job.advised)
    catch_early(job.args.save_on_signal)  # a preemption notice during start-up: stop after update 1
    try:
        return _train(job, role, world_size)
    finally:  # an in-process run (a test, a notebook) gets its signals' defaults back
        stop_catching_early(job.args.save_on_signal)


def _train(job: Job, role: Role, world_size: int) -> int:
    """train_worker's work once the job is known."""
    import torch
    import torch.distributed as dist

    from acco.data.prepare import prepare_data
    from acco.launch.process_group import decided_by_rank0, init_distributed, leave_the_store, stop_heartbeat
    from acco.trainer import DecoupledTrainer

    process = init_distributed(job.args.timeout_s)  # joined here once: the trainer is handed it
    rank, world_size, _, device = process
    if role is Role.WORKER:  # rank 0 validates once for all, the others wait and follow its verdict
        kind, _, line = decided_by_rank0(lambda: validated(job), key="validation").partition(" ")
        if kind != "ok":
            stop_heartbeat()
            leave_the_store()
            dist.destroy_process_group()
            if kind == "done":
                if rank == 0:
                    print(line, flush=True)
                return 0
            if rank == 0:
                raise InputError(line)
            return 1  # rank 0 prints the line
        if line:  # rank 0's resume decision, for every rank
            from acco.resume import ResumePoint

            job.resume = ResumePoint.from_json(line)
    args, out = job.args, Path(job.args.output_dir)
    data = prepare_data(job)  # every rank takes part in the waits on rank 0
    torch.manual_seed(args.seed)  # the initial weights are a function of train.seed: seeded once, here
    model = _build_model(job, data.tokenizer, device, announce=rank == 0)
    trainer = DecoupledTrainer(
        model=model, tokenizer=data.tokenizer, train_dataset=data.train, eval_dataset=data.eval, args=args,
        process=process, seeded=True,
        inputs_checked=True,  # by the validation pass (launcher, or rank 0): the CRC read once
        # the job as composed, once training starts (after a resume that succeeded: nothing is
        # replaced by a run that cannot continue the checkpoint)
        on_train_start=lambda: OmegaConf.save(job.config, out / "config.yaml"),
    )
    del data  # the trainer holds the rows
    summary = trainer.train(job.resume)  # where it resumes from, as the validation pass decided
    code = 0
    if summary.get("stopped_on_signal"):  # checkpointed: the same command with resume auto continues
        code = EXIT_SAVED_ON_SIGNAL
        if rank == 0:
            print(
                f"acco: stopped on {summary['stopped_on_signal']} after update "
                f"{summary['stopped_at_update']} ({summary['samples']} micro-batches), checkpointed in "
                f"{out}; run the same command with train.resume_from_checkpoint=auto to continue "
                f"(exit {code})",
                flush=True,
            )
    elif rank == 0 and not summary.get("nothing_to_do"):
        loss = summary.get("final_eval_loss")
        print(
            f"done: {summary['method']} {summary['samples']} micro-batches"
            f"{'' if loss is None else f', final eval loss {loss:.4f}'}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s, outputs in {out}",
            flush=True,
        )
    # Free the engine (DDP's reducer, the comm worker) while the interpreter is whole: a gloo
    # group whose last reference goes at interpreter exit can abort the process (a C++ thread
    # still holding work with Python tensors: "terminate called without an active exception").
    del trainer, model
    gc.collect()
    stop_heartbeat()  # before the store's host (rank 0) may exit
    leave_the_store()  # rank 0, its host, leaves last
    dist.destroy_process_group()
    return code


def _build_model(job: Job, tokenizer, device, announce: bool):
    """The model of job.model for this tokenizer, with the attention chosen for the device where
    the config names none (a pretrained model: by its type)."""
    from acco.models import attention_for, attention_of, build_model

    model_cfg, args = dict(job.model), job.args
    if not model_cfg.get("attn_implementation"):
        chosen = attention_for(model_cfg.get("arch"), device.type, args.use_mixed_precision)
        if chosen == "flash_attention_2" or not model_cfg.get("pretrained"):
            model_cfg["attn_implementation"] = chosen
    model = build_model(
        model_cfg,
        vocab_size=len(tokenizer),
        max_length=args.max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if announce:  # what is trained: the vocabulary is the tokenizer's (a small corpus's BPE may be short)
        n = sum(p.numel() for p in model.parameters())
        print(f"model: {model_cfg.get('name') or model_cfg.get('pretrained') or model_cfg.get('arch')}, "
              f"{n:,} parameters, vocabulary {len(tokenizer):,}; attention: {attention_of(model)} "
              "(model.attn_implementation=... to choose)", flush=True)
    return model


if __name__ == "__main__":
    entry()
