"""What every worker starts from, and the precision evaluation runs in.

- Workers built with different initial weights (a library user who did not seed alike) all train
  from rank 0's: the parameters and, in mixed precision, the fp32 master, which must be rank 0's
  fp32 weights (not the bf16-rounded ones, nor this rank's own).
- Evaluation runs under training's precision context: torch-ddp keeps fp32 parameters and trains
  under bf16 autocast, so its evaluation must run under autocast too.
"""

from __future__ import annotations

import torch
from distributed import run_distributed
from engine_helpers import config, make_model

from acco.engine import build_engine

WORLD = 2


def _initial_state(rank, world, methods):
    return {method: _built(rank, method) for method in methods}


def _built(rank, method):
    model = make_model("mlp")
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own initial weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    # as FlatParams lays them out: the decayed matrices first
    ordered = [p for p in model.parameters() if p.dim() >= 2] + [p for p in model.parameters() if p.dim() < 2]
    own = torch.cat([p.detach().flatten() for p in ordered])
    engine = build_engine(model, config(method=method, use_mixed_precision=True, nb_steps_tot=4))
    master = engine.comm.optimizer.master if hasattr(engine, "comm") else engine.local
    shard = engine.flat.shard if hasattr(engine, "comm") else slice(0, master.numel())
    engine.close()
    return own, engine.flat.params.clone(), master.clone(), shard


def test_every_worker_starts_from_rank0s_weights_and_its_fp32_master():
    """Without the broadcast before the master is taken, rank 1's master is its own weights."""
    methods = ("acco", "ddp", "wp", "diloco")
    rank0, rank1 = run_distributed(_initial_state, WORLD, methods)
    for method in methods:
        (own0, params0, _, _), (own1, params1, master1, shard1) = rank0[method], rank1[method]
        assert not torch.equal(own0, own1)  # the ranks did start apart
        padded = torch.zeros(params0.numel(), dtype=torch.float32)
        padded[: own0.numel()] = own0
        assert torch.equal(params1, params0) and torch.equal(params0, padded.to(torch.bfloat16)), method
        assert master1.dtype == torch.float32
        assert not torch.equal(padded[shard1], padded[shard1].bfloat16().float())  # bf16 would lose bits
        torch.testing.assert_close(master1, padded[shard1], rtol=0, atol=0, msg=method)


def _evaluate_under_autocast(rank, world):
    from omegaconf import OmegaConf
    from trainer_helpers import TINY

    from acco.data import load_tokenizer, synthetic_corpus
    from acco.models import build_model
    from acco.trainer import DecoupledTrainer

    docs = synthetic_corpus(60)
    tokenizer = load_tokenizer("bpe", train_texts=docs, vocab_size=300)
    model = build_model({**OmegaConf.load(TINY), "num_layers": 1}, vocab_size=len(tokenizer), max_length=16)
    args = dict(
        method_name="torch-ddp",
        use_mixed_precision=True,
        n_grad_accumulation=1,
        batch_size=2,
        max_length=16,
        nb_steps_tot=2,
        save=False,
        cache_dir=None,
        output_dir="unused",
    )
    trainer = DecoupledTrainer(model=model, tokenizer=tokenizer, train_dataset=docs, args=args)
    trainer.engine = build_engine(trainer.model, trainer.args.engine_config())
    seen = []
    # The loss runs the base model and its own fused head (acco/loss.py), and the base model's last
    # layer norm returns fp32 under autocast: watch the first linear layer's products instead.
    first_linear = next(m for m in model.base_model.modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(
        lambda m, i, o: seen.append((torch.is_autocast_enabled("cpu"), o.dtype))
    )
    trainer.evaluate()
    trainer.engine.close()
    return seen


def test_torch_ddp_evaluates_under_its_training_autocast():
    seen = run_distributed(_evaluate_under_autocast, 1)[0]
    assert seen and all(on and dtype == torch.bfloat16 for on, dtype in seen), seen
