"""`python main.py train=acco ...` and `acco-train ...`: Hydra config in, a trained model out.

A plain `python main.py` starts `launch.nproc` local workers of itself; under torchrun or srun
the environment already says who is who and each process trains directly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import acco.conf  # noqa: F401  (registers the resolvers the model configs use)
from acco.launch import after_rank0, dist_env, launch_local, self_command


def local_nproc(setting) -> int:
    if setting in (None, "auto"):
        import torch

        return torch.cuda.device_count() or 2
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"launch.nproc must be a positive integer or 'auto', got {setting!r}")
    return setting


def load_corpus(data: DictConfig):
    """Documents (pretraining) or instruction records (fine-tuning), as the data config says.

    Documents from table files or the Hub are a memory-mapped `datasets.Dataset`, not a list:
    an openwebtext-sized corpus then costs each worker next to no memory. Rank 0 loads first, so
    that a Hub dataset is downloaded and converted once; the others then open that copy.
    """
    from acco.data import load_records, open_documents, synthetic_corpus

    if data.name == "synthetic":
        return synthetic_corpus(int(data.n_docs), seed=0)

    def load():
        if data.format == "instruct":
            return load_records(data.path)
        return open_documents(data.path, text_column=data.text_column)

    corpus = after_rank0(load, key="corpus")
    return corpus if corpus is not None else load()


def split_corpus(corpus, args):
    """(train, eval) documents or records, eval None when train.eval is off.

    The eval split is carved here, by document and from train.seed, rather than by the trainer
    from packed blocks: the BPE tokenizer can then be trained on the training split only, and no
    document is cut between the two splits. Both are index views of `corpus`, not copies of it.
    """
    from acco.data import is_hf_dataset, split_train_eval

    if not args.eval:
        return corpus, None
    train_idx, eval_idx = split_train_eval(len(corpus), args.eval_fraction, args.seed)
    if is_hf_dataset(corpus):
        return corpus.select(train_idx.numpy()), corpus.select(eval_idx.numpy())
    return [corpus[i] for i in train_idx.tolist()], [corpus[i] for i in eval_idx.tolist()]


def prepare_tokenizer(cfg: DictConfig, train_corpus):
    """Rank 0 trains (on the training split only) or loads the tokenizer and saves it with the
    run; the others load that copy. A trained BPE is cached in train.cache_dir, keyed by the
    training texts and vocab_size, so that the next run on the same data reuses it."""
    from acco.data import format_alpaca, load_tokenizer

    saved = Path(cfg.train.output_dir) / "tokenizer"

    def build():
        if cfg.data.format == "pretrain":
            texts = train_corpus
        else:
            texts = ["".join(format_alpaca(r)) for r in train_corpus]
        load_tokenizer(
            cfg.model.tokenizer, train_texts=texts, vocab_size=int(cfg.model.vocab_size), save_dir=saved,
            cache_dir=cfg.train.get("cache_dir") or None, text_column=cfg.data.text_column,
        )  # fmt: skip

    after_rank0(build, key=f"tokenizer/{saved.resolve()}")
    return load_tokenizer(str(saved))


def train_from_config(cfg: DictConfig) -> dict:
    import torch
    import torch.distributed as dist

    from acco.launch import init_distributed
    from acco.models import build_model
    from acco.trainer import DecoupledTrainer, TrainArgs

    args = TrainArgs.from_any(cfg.train)
    rank, world_size, _, _ = init_distributed(args.timeout_s)
    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    train_corpus, eval_corpus = split_corpus(load_corpus(cfg.data), args)
    tokenizer = prepare_tokenizer(cfg, train_corpus)
    torch.manual_seed(args.seed)  # the initial weights are a function of train.seed
    model = build_model(
        cfg.model,
        vocab_size=len(tokenizer),
        max_length=args.max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    trainer = DecoupledTrainer(
        model=model, tokenizer=tokenizer, train_dataset=train_corpus, eval_dataset=eval_corpus,
        text_column_name=cfg.data.text_column, args=args,
    )  # fmt: skip
    summary = trainer.train()
    if rank == 0 and not summary.get("nothing_to_do"):
        print(
            f"done: {summary['method']} {summary['samples']} micro-batches, final eval loss "
            f"{summary['final_eval_loss']}, {summary['tokens_per_s']:,.0f} tokens/s, outputs in {out}",
            flush=True,
        )
    dist.destroy_process_group()
    return summary


def quiet_progress_bars(rank: int) -> None:
    """datasets' and transformers' own progress bars only on rank 0 in a terminal: in a log file
    their carriage returns make a mess, and every rank would print them."""
    if rank == 0 and sys.stderr.isatty():
        return
    # Environment variables, read when the libraries are imported: importing datasets here
    # would add a second and a half to the start of workers that never use it.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _preflight_finds_nothing_to_do(cfg: DictConfig, world_size: int, env: dict | None) -> bool:
    """Check the inputs (InputError), before anything is written; True, after one line from rank
    0, when the checkpoint to resume has already completed the budget."""
    import datasets

    from acco.validate import AlreadyCompleted, preflight

    # Preflight reads the data to check it: datasets' own logs ("Failed to load JSON ...") and
    # bars would only repeat, in other words, the one line we print.
    verbosity = datasets.logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        preflight(cfg, world_size=world_size)
    except AlreadyCompleted as done:
        if env is None or env["rank"] == 0:
            print(done, flush=True)
        return True
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    return False


def run(cfg: DictConfig) -> int:
    from acco.validate import InputError

    try:
        nproc = local_nproc(cfg.launch.nproc)
    except ValueError as e:
        raise InputError(str(e)) from e
    env = dist_env()
    quiet_progress_bars(env["rank"] if env else 0)
    if env is None and nproc > 1:
        if _preflight_finds_nothing_to_do(cfg, nproc, env):  # bad input fails here, before any worker starts
            return 0
        # As torchrun does: workers sharing a machine must not each spin up a thread per core.
        threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": max(1, (os.cpu_count() or 1) // nproc)}
        return launch_local(nproc, self_command(), env_extra={**threads, "ACCO_PREFLIGHT_DONE": "1"})
    if not os.environ.get("ACCO_PREFLIGHT_DONE"):  # torchrun, srun or one process: check here
        if _preflight_finds_nothing_to_do(cfg, env["world_size"] if env else 1, env):
            return 0
    train_from_config(cfg)
    return 0


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        code = run(cfg)
    except Exception as e:  # one clear line for the user; launch.debug=true shows the traceback
        from acco.validate import InputError, one_line_error

        if cfg.launch.get("debug") or os.environ.get("ACCO_DEBUG"):
            raise
        rank = os.environ.get("RANK")
        where = f"[rank {rank}] " if rank is not None else ""
        kind = "" if isinstance(e, InputError) else f"{type(e).__name__}: "
        print(f"acco: error: {where}{kind}{one_line_error(e)}", file=sys.stderr, flush=True)
        code = 1
    if code:
        sys.exit(code)


def main() -> None:
    from acco.validate import InputError, check_overrides

    debug = os.environ.get("ACCO_DEBUG") or "launch.debug=true" in [a.lower() for a in sys.argv[1:]]
    if not debug:
        try:  # an unknown group, option or key: one line instead of Hydra's report
            check_overrides(sys.argv[1:])
        except InputError as e:
            print(f"acco: error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
    _hydra_main()


if __name__ == "__main__":
    main()
