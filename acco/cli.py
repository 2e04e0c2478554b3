"""`python main.py train=acco ...` and `acco-train ...`: Hydra config in, a trained model out.

The path of a job, in the order it runs:

1. ``main``: the config is composed once, from acco/conf and the schema in acco/config.py.
2. ``run``: a plain ``python main.py`` is the local launcher (acco/launch/local.py). It starts
   ``launch.nproc`` workers of the same command at once and, while they import torch, runs the one
   validation pass (acco/validate.py); the workers start only once it has passed. Under torchrun
   or srun each process is a worker, and rank 0 validates while the others wait. With one worker
   the launcher is that worker.
3. ``train_worker``: the worker loads the corpus, the tokenizer and the model, and hands them to
   ``DecoupledTrainer`` (acco/trainer.py), whose engine (acco/engine) runs the comm rounds. A
   worker that ran the validation pass itself (launch.nproc=1, rank 0 under torchrun) starts from
   what the pass loaded (its ``Job``: the corpus, its split, the tokenizer, the model config).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import tempfile
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
from acco.launch.env import dist_env, self_command
from acco.launch.local import launch_local, local_nproc, wait_for_go

# The resolved config the launcher hands its workers, so that they do not compose it again.
JOB_CONFIG_ENV = "ACCO_JOB_CONFIG"


def quiet_progress_bars(rank: int) -> None:
    """datasets' and transformers' own progress bars only on rank 0 in a terminal: in a log file
    their carriage returns make a mess, and every rank would print them."""
    if rank == 0 and sys.stderr.isatty():
        return
    # Environment variables, read when the libraries are imported (not imported here: they cost
    # seconds of start-up).
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's


def run(cfg: DictConfig) -> int:
    env = dist_env()
    quiet_progress_bars(env["rank"] if env else 0)
    if env is not None:  # a worker: of this launcher, of torchrun or of srun
        return train_worker(cfg, checked=os.environ.get(JOB_CONFIG_ENV) is not None)
    from acco.validate import validate_job

    nproc = local_nproc(cfg.launch.nproc)
    try:
        if nproc == 1:  # this process is the worker: it starts from what the pass loaded
            return train_worker(cfg, job=validate_job(cfg, 1))
        with _job_config_file(cfg) as path:
            # As torchrun does: workers sharing a machine must not each spin up a thread per core.
            threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": max(1, (os.cpu_count() or 1) // nproc)}
            # The workers import while the launcher validates; they start work once it has passed.
            # A preemption notice is forwarded, and the launcher waits while the workers checkpoint.
            save_signals = [signal.Signals[name] for name in cfg.train.save_on_signal]
            return launch_local(nproc, self_command(), env_extra={**threads, JOB_CONFIG_ENV: path},
                                check=lambda: validate_job(cfg, nproc), save_signals=save_signals)  # fmt: skip
    except AlreadyCompleted as done:  # the checkpoint to resume has completed the budget
        print(done, flush=True)
        return 0


@contextlib.contextmanager
def _job_config_file(cfg: DictConfig):
    """The resolved config in a temporary file for the workers, removed when the launcher ends."""
    fd, path = tempfile.mkstemp(prefix="acco-job-", suffix=".yaml")
    os.close(fd)
    try:
        OmegaConf.save(cfg, path, resolve=True)
        yield path
    finally:
        os.unlink(path)


def train_worker(cfg: DictConfig, checked: bool = False, job=None) -> int:
    """One worker's job: import what training needs (the local launcher validates meanwhile), wait
    for its go, validate on rank 0 unless a launcher did (`checked`, or `job`: what this process's
    validation pass loaded), then train."""
    import torch
    import torch.distributed as dist

    from acco.data.prepare import load_corpus_rank0_first, prepare_tokenizer, split_corpus
    from acco.launch.process_group import decided_by_rank0, init_distributed, stop_heartbeat
    from acco.models import attention_for, attention_of, build_model
    from acco.trainer import DecoupledTrainer, TrainArgs

    wait_for_go()
    args = job.args if job is not None else TrainArgs.from_any(cfg.train)
    rank, world_size, _, device = init_distributed(args.timeout_s)
    if not checked and job is None:  # torchrun / srun: rank 0 validates once for all, the others wait
        passed = {}
        verdict = decided_by_rank0(lambda: _verdict(cfg, world_size, passed), key="validation")
        job = passed.get("job")  # rank 0's pass
        kind, _, line = verdict.partition(" ")
        if kind != "ok":
            stop_heartbeat()
            dist.destroy_process_group()
            if kind == "done":
                if rank == 0:
                    print(line, flush=True)
                return 0
            if rank == 0:
                raise InputError(line)
            return 1  # rank 0 prints the line
    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    # every rank takes part in the waits on rank 0, including a rank 0 that starts from its pass
    corpus = load_corpus_rank0_first(cfg.data, loaded=getattr(job, "corpus", None))
    train_corpus, eval_corpus = getattr(job, "splits", None) or split_corpus(corpus, args)
    tokenizer = prepare_tokenizer(cfg, train_corpus, built=getattr(job, "tokenizer", None))
    torch.manual_seed(args.seed)  # the initial weights are a function of train.seed
    model_cfg = dict(job.model) if job is not None else OmegaConf.to_container(cfg.model, resolve=True)
    if not model_cfg.get("attn_implementation"):  # chosen for the device (a pretrained model: by its type)
        chosen = attention_for(model_cfg.get("arch"), device.type, args.use_mixed_precision)
        if chosen == "flash_attention_2" or not model_cfg.get("pretrained"):
            model_cfg["attn_implementation"] = chosen
    model = build_model(
        model_cfg, vocab_size=len(tokenizer), max_length=args.max_length, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    if rank == 0:
        print(f"attention: {attention_of(model)} (model.attn_implementation=... to choose)", flush=True)
    trainer = DecoupledTrainer(
        model=model, tokenizer=tokenizer, train_dataset=train_corpus, eval_dataset=eval_corpus,
        text_column_name=cfg.data.text_column, args=args,
    )  # fmt: skip
    summary = trainer.train()
    code = 0
    if summary.get("stopped_on_signal"):  # checkpointed: the same command with resume auto continues
        code = EXIT_SAVED_ON_SIGNAL
        if rank == 0:
            print(f"acco: stopped on {summary['stopped_on_signal']} after update {summary['stopped_at_update']} "
                  f"({summary['samples']} micro-batches), checkpointed in {out}; run the same command with "
                  f"train.resume_from_checkpoint=auto to continue (exit {code})", flush=True)
    elif rank == 0 and not summary.get("nothing_to_do"):
        print(
            f"done: {summary['method']} {summary['samples']} micro-batches, final eval loss "
            f"{summary['final_eval_loss']}, {summary['tokens_per_s']:,.0f} tokens/s, outputs in {out}",
            flush=True,
        )
    # Free the engine (DDP's reducer, the comm worker) while the interpreter is whole: a gloo
    # group whose last reference goes at interpreter exit can abort the process (a C++ thread
    # still holding work with Python tensors: "terminate called without an active exception").
    del trainer, model
    gc.collect()
    stop_heartbeat()  # before the store's host (rank 0) may exit
    dist.destroy_process_group()
    return code


def _verdict(cfg: DictConfig, world_size: int, passed: dict) -> str:
    """Rank 0's validation, as the one word and line every rank acts on: ok, done or error; what
    the pass loaded goes to ``passed["job"]``, for rank 0 to start from."""
    from acco.validate import validate_job

    try:
        passed["job"] = validate_job(cfg, world_size)
    except AlreadyCompleted as done:
        return f"done {done}"
    except Exception as e:
        return f"error {one_line_error(e)}"
    return "ok "


def _report(e: BaseException) -> None:
    rank = os.environ.get("RANK")
    where = f"[rank {rank}] " if rank is not None else ""
    kind = "" if isinstance(e, InputError) else f"{type(e).__name__}: "
    # one write of the whole line (print writes its newline apart where stderr is unbuffered)
    sys.stderr.write(f"acco: error: {where}{kind}{one_line_error(e)}\n")
    sys.stderr.flush()


def job_config(argv: list[str]) -> DictConfig:
    """The config of this job: the launcher's file in its workers, else composed from `argv`."""
    path = os.environ.get(JOB_CONFIG_ENV)
    if path and dist_env() is not None:
        from acco.config import Config

        return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    return compose(argv)


def main() -> None:
    argv = sys.argv[1:]
    # acco's own progress notes (caches found, examples dropped) on stdout, as print's lines
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("acco").addHandler(handler)
    logging.getLogger("acco").setLevel(logging.INFO)
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (--help, --cfg job, -m ...)
        return _hydra_app()
    debug = os.environ.get("ACCO_DEBUG") or "launch.debug=true" in [a.lower() for a in argv]
    try:
        cfg = job_config(argv)
        debug = debug or cfg.launch.debug
        code = run(cfg)
    except Exception as e:  # one clear line for the user; launch.debug=true shows the traceback
        if debug:
            raise
        _report(e)
        code = 1
    if code:
        sys.exit(code)


def _hydra_app() -> None:
    import hydra

    @hydra.main(version_base="1.3", config_path="conf", config_name="config")
    def app(cfg: DictConfig) -> None:
        check_values(cfg)  # as compose does: Hydra's composition runs no group's value checks
        code = run(cfg)
        if code:
            sys.exit(code)

    app()


if __name__ == "__main__":
    main()
