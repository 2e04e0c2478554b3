"""``acco-bench faults``' results: the workers' exit codes from the agent's log, the bit-for-bit
comparison of the faulted run with the uninterrupted one, the summary and the report
(acco_bench/faults.py runs the drill)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from acco_bench.fault_job import metrics

_EXIT = re.compile(
    r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)|exitcode\s*: (-?\d+) \(pid: (\d+)\)"
)


def worker_exit_codes(log_path: Path) -> dict[int, int]:
    """pid -> exit code, from the agent's log lines (it logs a group's failures before restarting it)."""
    codes = {}
    for m in _EXIT.finditer(log_path.read_text(errors="replace")):
        code, pid = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
        codes[int(pid)] = int(code)
    return codes


# --------------------------------------------------------------------------------------------
# the comparison


def bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _tensors(state, name: str = ""):
    import torch

    if isinstance(state, torch.Tensor):
        yield name, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{name}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{name}[{i}]")


def compare_runs(straight: Path, faulted: Path) -> dict:
    """The final state of the two runs, bit for bit: the saved model, every rank file's tensors of
    the final checkpoint (master shard, moments, accumulator, ...), and the logged losses."""
    from safetensors.torch import load_file

    from acco import checkpoint
    from acco.resume import load_meta
    from acco.run_folder import list_checkpoints

    a_ck, b_ck = list_checkpoints(straight)[-1], list_checkpoints(faulted)[-1]
    out = {"straight_checkpoint": a_ck.name, "faulted_checkpoint": b_ck.name}
    a_model, b_model = (
        load_file(straight / "model" / "model.safetensors"),
        load_file(faulted / "model" / "model.safetensors"),
    )
    out["model_bit_equal"] = a_model.keys() == b_model.keys() and all(
        bits_equal(a_model[k], b_model[k]) for k in a_model
    )
    meta = load_meta(a_ck)
    world = int(meta["world_size"])
    differing, master, compared = [], True, 0
    for rank in range(world):
        a = dict(_tensors(checkpoint.load_worker(a_ck, rank, world)))
        b = dict(_tensors(checkpoint.load_worker(b_ck, rank, world)))
        for name in sorted(a.keys() | b.keys()):
            same = name in a and name in b and bits_equal(a[name], b[name])
            compared += 1
            if not same:
                differing.append(f"rank{rank}{name}")
                master = master and name != "/engine/master"
    out.update(
        master_bit_equal=master and a_ck.name == b_ck.name,
        checkpoint_tensors_compared=compared,
        checkpoint_tensors_differing=differing,
    )
    out["final_params_bit_equal"] = bool(out["model_bit_equal"] and out["master_bit_equal"])
    a_m, b_m = metrics(straight), metrics(faulted)
    losses = [{x["step"]: x.get("loss") for x in m if x["type"] == "train"} for m in (a_m, b_m)]
    evals = [[x["eval_loss"] for x in m if x["type"] == "eval"] for m in (a_m, b_m)]
    out.update(
        train_losses_equal=losses[0] == losses[1],
        eval_losses_equal=evals[0] == evals[1],
        final_eval_loss=evals[1][-1] if evals[1] else None,
        updates=max(losses[1]) if losses[1] else 0,
    )
    return out



def summarize(bench: dict) -> dict:
    s = bench["config"]
    faulted, cmp_ = bench["faulted"], bench["comparison"]
    faults = faulted["faults"]
    finished = faulted["exit_code"] == 0
    for f in faults:
        f["survived"] = finished and "next_resumed_from" in f
    lost = [f["lost_updates"] for f in faults if "lost_updates" in f]
    # a host crash loses its newest checkpoint too: one save interval more
    allowed = [s["save_step"] * (1 + (f["kind"] == "host-crash")) for f in faults if "lost_updates" in f]
    recover = [f["recover_s"] for f in faults if f.get("recover_s") is not None]
    startup = [f["training_s"] - f["restart_s"] for f in faults if f.get("training_s") is not None]
    return {
        "faults_planned": s["faults"],
        "faults_injected": len(faults),
        "faults_survived": sum(f["survived"] for f in faults),
        "unplanned_failures": len(faulted["unplanned"]),
        "restarts": faulted["attempts"] - 1,
        "finished": finished,
        "lost_updates_max": max(lost) if lost else None,
        "lost_updates_total": sum(lost),
        "lost_updates_mean": round(statistics.mean(lost), 2) if lost else None,
        "at_most_one_save_interval_lost": bool(lost) and all(n <= m for n, m in zip(lost, allowed)),
        "recover_s_median": round(statistics.median(recover), 2) if recover else None,
        "recover_s_max": max(recover) if recover else None,
        "startup_s_median": round(statistics.median(startup), 2) if startup else None,
        "down_s_max": max(f["down_s"] for f in faults) if faults else None,
        "final_params_bit_equal": cmp_["final_params_bit_equal"],
        "all_checkpoint_tensors_bit_equal": not cmp_["checkpoint_tensors_differing"],
        "losses_equal": cmp_["train_losses_equal"] and cmp_["eval_losses_equal"],
        "overhead_s": round(faulted["wall_s"] - bench["straight"]["wall_s"], 1),
    }


def passed(bench: dict) -> bool:
    m = bench.get("summary") or {}
    return bool(
        m
        and m["finished"]
        and m["faults_survived"] == m["faults_planned"]
        and not m["unplanned_failures"]
        and m["final_params_bit_equal"]
        and m["at_most_one_save_interval_lost"]
    )


def markdown(bench: dict) -> str:
    c = bench["config"]
    lines = [f"# acco-bench faults: {c['workers']} workers under torchrun, {c['faults']} faults", ""]
    if bench.get("command"):
        lines += [f"Command: `{bench['command']}`", ""]
    m = bench.get("machine") or {}
    lines += [
        f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), torch {m.get('torch')}, gloo. Job: acco, "
        f"fixed batch, model {c['model']}, synthetic data, a checkpoint every {c['save_step']} updates, "
        f"{c['budget_updates']} updates; {c['store']}.",
        "",
    ]
    if bench.get("error"):
        lines += ["**The drill failed:**", "", "```", bench["error"], "```", ""]
    lines += _faults_table(bench)
    lines += _summary(bench)
    return "\n".join(lines)


def _faults_table(bench: dict) -> list[str]:
    """Each fault injected: where, when, what was lost and how long the job took to recover."""
    from acco_bench.report import fmt, md_table

    faulted = bench.get("faulted")
    if not faulted:
        return []
    lines = []
    rows = [
        [
            i + 1,
            f["kind"],
            f["signal"],
            f["rank"],
            f["attempt"],
            f["during"],
            f["resumed_from"],
            f["reached"],
            f.get("next_resumed_from", "-"),
            f.get("lost_updates", "-"),
            fmt(f["down_s"], 1),
            fmt(f.get("restart_s"), 1),
            fmt(f.get("training_s"), 1),
            fmt(f.get("recover_s"), 1),
            ", ".join(f"rank {r}: {v}" for r, v in f.get("worker_exit_codes", {}).items()),
        ]
        for i, f in enumerate(faulted["faults"])
    ]
    lines += [
        md_table(
            [
                "#",
                "fault",
                "signal",
                "rank",
                "attempt",
                "during",
                "resumed from",
                "reached",
                "next resumed from",
                "lost (updates)",
                "down s",
                "restart s",
                "training s",
                "recover s",
                "first exit",
            ],
            rows,
        ),
        "",
    ]
    lines += [
        "*reached*: the newest update any worker logged before the group ended; *lost* = reached minus "
        "the update the next attempt resumed from; *down*: from the signal to the last worker's exit; "
        "*restart*: to the next group's workers; *training*: to its start of training (rank 0's "
        "TensorBoard file: the workers have imported, loaded the data and the model); *recover*: to its "
        "first new update (none when that group was itself killed in its warm start); *first exit*: the "
        "exit code of the worker that failed first, as torchrun logs it (75: checkpointed on the "
        "signal).",
        "",
    ]
    if faulted["unplanned"]:
        lines += [f"Attempts that ended without a fault of the drill: {faulted['unplanned']}", ""]
    return lines


def _summary(bench: dict) -> list[str]:
    """The drill's outcome: faults survived, work lost, time to recover, and the final parameters
    against the uninterrupted run's."""
    from acco_bench.report import fmt

    s = bench.get("summary")
    if not s:
        return []
    c, m, faulted = bench["config"], bench.get("machine") or {}, bench.get("faulted")
    lines = []
    st = bench["straight"]
    differing = bench["comparison"].get("checkpoint_tensors_differing", [])
    lines += [
        f"- Faults injected {s['faults_injected']} of {s['faults_planned']}, survived "
        f"{s['faults_survived']}; restarts {s['restarts']}, failures not injected by the drill "
        f"{s['unplanned_failures']}; the job "
        + ("finished (exit 0)." if s["finished"] else "did **not** finish."),
        f"- Work lost per fault: at most {s['lost_updates_max']} updates (mean {s['lost_updates_mean']}, "
        f"{s['lost_updates_total']} in all; a save every {c['save_step']}): "
        + ("at most one save interval (two for a host crash)." if s["at_most_one_save_interval_lost"]
           else "**more than one save interval** (two for a host crash)."),
        f"- Time to recover (signal to the first new update): median {fmt(s['recover_s_median'], 1)} s, "
        f"max {fmt(s['recover_s_max'], 1)} s, of which the new group's start-up (its workers started to "
        f"its start of training) median {fmt(s.get('startup_s_median'), 1)} s; the group was down within "
        f"{fmt(s['down_s_max'], 1)} s of a signal at most.",
        "- Final parameters bit-equal to the uninterrupted run's: "
        f"**{'yes' if s['final_params_bit_equal'] else 'no'}** (the saved model and every rank's master "
        "shard); every tensor of the final checkpoint "
        f"({bench['comparison']['checkpoint_tensors_compared']}): "
        f"{'equal' if s['all_checkpoint_tensors_bit_equal'] else 'differ: ' + ', '.join(differing)}; "
        f"losses and evaluations: {'equal' if s['losses_equal'] else 'differ'}.",
        f"- Wall clock: uninterrupted {st['wall_s']:.0f} s ({st['update_s']:.2f} s per update), under "
        "faults "
        f"{faulted['wall_s']:.0f} s; other processes used {fmt(st.get('other_cpu_cores'), 2)} and "
        f"{fmt(faulted.get('other_cpu_cores'), 2)} CPU cores meanwhile (of {m.get('cpus')}).",
        "",
    ]
    return lines
