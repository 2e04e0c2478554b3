"""``acco-bench convergence``: loss at equal samples for every method, several seeds, on real text;
and the update-closeness figure of the paper's review discussion.

Convergence: the methods run one after the other through the training CLI (2 workers on loopback
by default: the loss per sample does not depend on the network), each seed with the same data
order, initial weights, hyper-parameters and budget (``nb_steps_tot`` micro-batches over all
workers) for every method, the fixed-batch mode by default (acco ``grad_accum / 2`` micro-batches
per round against the others' ``grad_accum`` per update). Eval loss is read from each run's
``metrics.jsonl`` every ``eval_step`` updates.

Update closeness (:func:`update_closeness`, in-process, engine pieces on one CPU worker): from one
state (theta_t and the AdamW moments after some plain Adam steps) and the same 2k micro-batches,

- ``u_adam`` = Opt(theta_t, mean gradient of the 2k micro-batches at theta_t) - theta_t;
- ``u_acco`` = Opt(theta_t, mean of [k gradients at theta~, k gradients at theta_t]) - theta_t, with
  theta~ either one trial step ahead, ``Opt_trial(theta_t, first half)`` (the brief's recipe), or
  the estimate the algorithm really uses, ``theta~_t = Opt_trial(theta_{t-1}, half batch)``,
  made from the previous state with the first half of the previous batch;

and reports ||u_acco - u_adam|| / (||u_acco|| + ||u_adam||), with the same measure between two
plain Adam updates on two different batches as a scale (what batch noise alone gives). Every
optimizer step here is ``ShardedAdamW.trial`` (the engine's own, which changes no state), so both
updates start from exactly the same optimizer state.
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

from acco_bench import BenchError
from acco_bench.analysis import read_jsonl, summary_stats
from acco_bench.network import Network
from acco_bench.settings import BenchSettings, model_settings
from acco_bench.workers import check_worker_available, run_workers

TINYSTORIES = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories" / "TinyStories-valid-head.txt"
)


def run_convergence(settings: BenchSettings, seeds: list[int], out: Path, closeness: bool = True,
                    closeness_only: bool = False, closeness_steps=(1, 20, 50, 100), log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if not seeds:
        raise BenchError("no seed given")
    conv: dict = {"config": {**settings.describe(), "seeds": seeds}, "runs": {}, "curves": {},
                  "final_eval_loss": {}, "failed": []}
    if not closeness_only:
        settings.validate()
        check_worker_available()
        if settings.data == "text" and not settings.data_path:
            raise BenchError("convergence needs --data PATH (a text file, e.g. the TinyStories slice)")
        with Network(settings.hosts, settings.bandwidth, None, settings.loopback,
                     settings.workers_per_node) as net:
            conv["config"]["network"] = net.note
            log(f"[acco-bench] convergence on {settings.data_path or settings.data}: {net.note}")
            for seed in seeds:
                s = replace(settings, seed=seed)
                for method in settings.methods:
                    run_dir = out / f"seed{seed}" / method
                    if run_dir.exists():
                        shutil.rmtree(run_dir)
                    try:
                        wall = run_workers(s, method, run_dir, net)
                    except BenchError as e:
                        log(f"[acco-bench] {method} seed {seed} FAILED: {e}")
                        conv["failed"].append({"method": method, "seed": seed, "error": str(e)})
                        continue
                    rows = read_jsonl(run_dir / "metrics.jsonl")
                    evals = [
                        (r["samples"] * s.batch_size, r["eval_loss"]) for r in rows if r.get("type") == "eval"
                    ]
                    train = [r for r in rows if r.get("type") == "train"]
                    summary = (
                        json.loads((run_dir / "summary.json").read_text())
                        if (run_dir / "summary.json").exists()
                        else {}
                    )
                    final = summary.get("final_eval_loss", evals[-1][1] if evals else None)
                    conv["runs"].setdefault(method, {})[str(seed)] = {
                        "final_eval_loss": final,
                        "samples": train[-1]["samples"] * s.batch_size if train else None,
                        "updates": len(train),
                        "wall_s": wall,
                        "final_train_loss": train[-1]["loss"] if train else None,
                    }
                    conv["curves"].setdefault(method, {})[str(seed)] = evals
                    log(f"[acco-bench] {method} seed {seed}: final eval loss {final}")
        for method, by_seed in conv["runs"].items():
            conv["final_eval_loss"][method] = summary_stats([r["final_eval_loss"] for r in by_seed.values()])
            ddp = conv["runs"].get("ddp", {})
            diffs = [
                r["final_eval_loss"] - ddp[k]["final_eval_loss"]
                for k, r in by_seed.items()
                if k in ddp and r["final_eval_loss"] is not None and ddp[k]["final_eval_loss"] is not None
            ]
            if method != "ddp" and diffs:
                conv["final_eval_loss"][method]["paired_diff_vs_ddp"] = summary_stats(diffs)
    if closeness:
        try:
            conv["update_closeness"] = update_closeness(
                data_path=settings.data_path if settings.data == "text" else None,
                tokenizer=settings.tokenizer or "bpe", model=settings.model, model_size=settings.model_size,
                batch_size=settings.batch_size, max_length=settings.max_length, k=settings.grad_accum,
                steps=closeness_steps, seed=seeds[0], threads=settings.worker_threads() * settings.workers)
        except Exception as e:  # noqa: BLE001 - reported, not fatal to the loss table
            log(f"[acco-bench] update closeness failed: {type(e).__name__}: {e}")
            conv["update_closeness"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "convergence.json").write_text(json.dumps(conv, indent=2, default=str) + "\n")
    from acco_bench.training_report import write_convergence_report

    write_convergence_report(conv, out)
    return conv


# --------------------------------------------------------------------------------------------
# update closeness


def update_closeness(data_path: str | None, tokenizer: str = "bpe", model: str = "tiny", model_size=None,
                     batch_size: int = 8, max_length: int = 64, k: int = 4, steps=(1, 20, 50, 100),
                     lr: float = 3e-3, seed: int = 0, threads: int | None = None, n_docs: int = 500) -> dict:
    """The normalised difference between acco+Adam and plain Adam updates (see the module doc).

    ``k`` micro-batches per half: an update uses ``2k`` micro-batches of ``batch_size`` sequences.
    ``steps``: measure after that many plain Adam updates (each one of 2k micro-batches).
    """
    import torch

    from acco.data import MicroBatchStream, load_documents, load_tokenizer, pack_documents, synthetic_corpus
    from acco.engine.config import EngineConfig
    from acco.engine.flat import FlatParams
    from acco.engine.optim import ShardedAdamW
    from acco.models import build_model, count_parameters

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    docs = load_documents(data_path) if data_path else synthetic_corpus(n_docs, seed=0)
    mcfg = model_settings(model, model_size or {})
    tok = load_tokenizer(tokenizer, train_texts=docs, vocab_size=int(mcfg.get("vocab_size") or 2048))
    blocks = pack_documents(docs, tok, max_length)
    net = build_model(mcfg, vocab_size=len(tok), max_length=max_length)
    flat = FlatParams(net, torch.float32, 1, 0)
    # the library's AdamW (weight decay, betas) at a constant learning rate
    cfg = EngineConfig(method="acco", learning_rate=lr, scheduler_name="constant", nb_steps_tot=10**9)
    master = flat.params.detach().clone()
    opt = ShardedAdamW(master, cfg)
    stream = MicroBatchStream(blocks, batch_size, 0, 1, seed)
    probe = _AdamProbe(net, flat, opt, master, lr)

    steps = sorted(set(int(s) for s in steps if int(s) >= 1))
    if not steps:
        raise BenchError("update closeness needs at least one measurement point >= 1 Adam step")
    points = []
    done = 0
    prev_state = prev_half = None
    net.train()
    for target in steps:
        while done < target:
            batch = [next(stream) for _ in range(2 * k)]
            prev_state = probe.snapshot()
            prev_half = batch[:k]
            g = probe.grad_sum(master, batch) / (2 * k)
            opt.commit(g, lr)
            done += 1
        points.append({"after_steps": target, **_closeness_point(probe, stream, k, prev_state, prev_half)})
    return {
        "model": model,
        "model_size": model_size or {},
        "params": count_parameters(net),
        "data": data_path or "synthetic",
        "tokenizer": tokenizer,
        "batch_size": batch_size,
        "max_length": max_length,
        "micro_batches": 2 * k,
        "lr": lr,
        "weight_decay": cfg.weight_decay,
        "betas": [cfg.adam_beta1, cfg.adam_beta2],
        "seed": seed,
        "points": points,
        "mean_brief": statistics.fmean(p["brief"] for p in points),
        "mean_algorithm": statistics.fmean(p["algorithm"] for p in points),
        "mean_noise": statistics.fmean(p["noise"] for p in points),
    }


class _AdamProbe:
    """The model's summed gradient at any parameters, and the library's AdamW step from any saved
    optimizer state, without changing the optimizer's own state."""

    def __init__(self, net, flat, opt, master, lr: float):
        self.net, self.flat, self.opt, self.master, self.lr = net, flat, opt, master, lr

    def grad_sum(self, theta, batches):
        self.flat.params.copy_(theta)
        self.flat.grads.zero_()
        for b in batches:
            self.net(**b).loss.backward()
        return self.flat.grads.clone()

    def snapshot(self) -> dict:
        return {k: v.detach().clone() for k, v in self.opt.state_tensors().items()}

    def trial(self, state: dict, g):
        """What a committed step from `state` with gradient g would give (no state changes)."""
        import torch

        now = self.snapshot()
        for key, t in self.opt.state_tensors().items():
            t.copy_(state[key])
        self.opt.restore_step(int(state["step"]))
        out = torch.empty_like(self.master)
        self.opt.trial(g.clone(), self.lr, out=out)
        for key, t in self.opt.state_tensors().items():
            t.copy_(now[key])
        self.opt.restore_step(int(now["step"]))
        return out


def _closeness(u, v) -> float:
    return float((u - v).norm() / (u.norm() + v.norm()))


def _closeness_point(probe: _AdamProbe, stream, k: int, prev_state: dict, prev_half: list) -> dict:
    """At the optimizer's current state: the brief's and the algorithm's update, and another batch's
    (the noise floor), each against plain Adam's update on the same 2k micro-batches."""
    state = probe.snapshot()
    theta = probe.master.clone()
    batch = [next(stream) for _ in range(2 * k)]
    other = [next(stream) for _ in range(2 * k)]
    first, second = batch[:k], batch[k:]
    g_first = probe.grad_sum(theta, first)
    g_second = probe.grad_sum(theta, second)
    u_adam = probe.trial(state, (g_first + g_second) / (2 * k)) - theta
    u_other = probe.trial(state, probe.grad_sum(theta, other) / (2 * k)) - theta
    # the brief's recipe: theta~ one trial step ahead, with the first half
    theta_tilde = probe.trial(state, g_first / k)
    u_brief = probe.trial(state, (g_first + probe.grad_sum(theta_tilde, second)) / (2 * k)) - theta
    # the algorithm's estimate of theta_t, from the previous state and half of the previous batch
    prev_theta = prev_state["master"]
    theta_est = probe.trial(prev_state, probe.grad_sum(prev_theta, prev_half) / k)
    u_algo = probe.trial(state, (probe.grad_sum(theta_est, first) + g_second) / (2 * k)) - theta
    return {"brief": _closeness(u_brief, u_adam), "algorithm": _closeness(u_algo, u_adam),
            "noise": _closeness(u_other, u_adam),
            "estimate_error": float((theta_est - theta).norm() / (theta - prev_theta).norm()),
            "u_adam_norm": float(u_adam.norm())}


# --------------------------------------------------------------------------------------------
# small per-worker batches


def batch_size_settings(settings: BenchSettings, b: int) -> BenchSettings:
    """``settings`` at ``b`` sequences per micro-batch with the same sequences (tokens) in all:
    ``nb_steps_tot`` (micro-batches) and ``eval_step`` (updates) scale by batch_size / b, so the
    budget and the evaluation points fall at the same samples; micro-batches per update stay."""
    samples = settings.nb_steps_tot * settings.batch_size
    if b < 1 or samples % b:
        raise BenchError(f"--batch-sizes: {b} does not divide the budget of {samples} sequences "
                         f"(--nb-steps-tot {settings.nb_steps_tot} x --batch-size {settings.batch_size})")
    eval_step = max(1, round(settings.eval_step * settings.batch_size / b)) if settings.eval_step else None
    return replace(settings, batch_size=b, nb_steps_tot=samples // b, eval_step=eval_step)


def run_batch_sizes(
    settings: BenchSettings, seeds: list[int], batch_sizes: list[int], out: Path, log=print
) -> dict:
    """:func:`run_convergence` (no closeness measurement) at every per-worker micro-batch size in
    ``batch_sizes``, each in ``out/bs{b}``; then ``batch_sizes.json`` and ``batch_sizes.md``: the
    final eval loss of every method at each size, mean over the seeds, and acco's paired
    difference to ddp."""
    if not batch_sizes:
        raise BenchError("--batch-sizes: no batch size given")
    per_size = [batch_size_settings(settings, b) for b in batch_sizes]  # every error before any run
    out.mkdir(parents=True, exist_ok=True)
    table = {"config": {**settings.describe(), "seeds": seeds, "batch_sizes": batch_sizes,
                        "samples": settings.nb_steps_tot * settings.batch_size},
             "sizes": {}, "failed": []}
    for b, s in zip(batch_sizes, per_size):
        log(f"[acco-bench] convergence at {b} sequence(s) per micro-batch: nb_steps_tot {s.nb_steps_tot}, "
            f"eval every {s.eval_step} updates")
        conv = run_convergence(s, seeds, out / f"bs{b}", closeness=False, log=log)
        table["sizes"][str(b)] = {"nb_steps_tot": s.nb_steps_tot, "eval_step": s.eval_step,
                                  "final_eval_loss": conv["final_eval_loss"]}
        table["failed"] += [{**f, "batch_size": b} for f in conv["failed"]]
    (out / "batch_sizes.json").write_text(json.dumps(table, indent=2, default=str) + "\n")
    (out / "batch_sizes.md").write_text(batch_sizes_markdown(table))
    return table


def batch_sizes_markdown(table: dict) -> str:
    from acco_bench.report import fmt, md_table

    cfg = table["config"]
    methods = list(cfg["methods"])
    rows = []
    for b, entry in table["sizes"].items():
        losses = entry["final_eval_loss"]
        row = [b, entry["nb_steps_tot"]]
        for m in methods:
            t = losses.get(m) or {}
            row.append(f"{fmt(t.get('mean'), 4)} ± {fmt(t.get('std'), 4)} (n={t.get('n', 0)})")
        for m in methods:
            if m == "ddp":
                continue
            pd = (losses.get(m) or {}).get("paired_diff_vs_ddp") or {}
            ref = (losses.get("ddp") or {}).get("mean")
            rel = pd["mean"] / ref * 100 if pd.get("n") and ref else None
            row.append(
                f"{fmt(pd.get('mean'), 4)} ± {fmt(pd.get('std'), 4)} ({fmt(rel, 2, '%')})"
                if pd.get("n")
                else "-"
            )
        rows.append(row)
    header = [
        "sequences per micro-batch",
        "micro-batches (all workers)",
        *(f"{m} final eval loss" for m in methods),
        *(f"{m} - ddp, same seed" for m in methods if m != "ddp"),
    ]
    return (
        "\n".join(
            [
                "# acco-bench convergence: small per-worker batches "
                f"({cfg.get('data_path') or cfg.get('data')})",
                "",
                f"{cfg['hosts']} workers, {cfg['samples']} sequences of {cfg['max_length']} tokens in all at "
                f"every size, {cfg['grad_accum']} micro-batches per worker per update (acco "
                f"{cfg['grad_accum'] // 2} per round), seeds {cfg['seeds']} (mean ± std), "
                f"accumulate_while_waiting {cfg['accumulate_while_waiting']}. "
                "nb_steps_tot and the evaluation step scale with 1 / size: the same samples, more updates.",
                "",
                md_table(header, rows),
                "",
            ]
        )
        + "\n"
    )
