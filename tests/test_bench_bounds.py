"""acco-bench's bounds, without workers: acco-bench map (the bounds per method on hand-computed
cases, the memory table, the winner rule, its CLI) and each acco variant measured against the bound
of the overrides it ran with, in cluster's comparisons, its report and map's check."""

from __future__ import annotations

import json

import pytest

from acco_bench import BenchError
from acco_bench.analysis import add_comparisons
from acco_bench.cli import main
from acco_bench.settings import BenchSettings


def test_map_bounds_winners_and_cli(tmp_path, capsys):
    """acco-bench map: the bounds on hand-computed cases, the memory table against
    docs/algorithm.md's figures, the winner rule, and the CLI's files (with a bench.json)."""
    from acco_bench.acco_bound import int8_ratio
    from acco_bench.map import GPT_NEO, Case, bounds, flops_per_token, memory_bytes, winner

    t = bounds(Case(c=1.0, m=0.5, workers=2, elem_bytes=4, grad_accum=4, buckets=1))
    assert int8_ratio(4) == pytest.approx(0.25048828125) and int8_ratio(2) == pytest.approx(0.5009765625)
    expect = {"ddp": 1.5, "dpu": 1.0, "wp": 1.0, "acco": 1.0, "acco-int8": 1.0, "acco-int8-even": 1.0,
              # C + max(0, M - M/B - (2/3) C/k) + M/B + M/2: the all-reduce, then ZeRO's fp32 broadcast
              "torch-ddp": 1.0 + 0.0 + 0.5 + 0.25,
              "diloco": 1.0 + 0.5 / 10, "streaming-diloco": 1.0}  # M/F = 0.125 hides under tau C = 1
    assert t == pytest.approx(expect)
    t = bounds(Case(c=1.0, m=0.8, elem_bytes=4))  # the estimate round's split decides
    assert t["acco"] == pytest.approx(1.6) and t["acco-int8"] == pytest.approx(0.8 * 1.25048828125)
    assert t["acco-int8-even"] == pytest.approx(0.5 + 0.8)
    t = bounds(Case(c=1.0, m=1.0, elem_bytes=2, grad_accum=1, buckets=4, s_sync_every=4, fragments=2,
                    fragment_delay=0))
    assert t["acco-int8"] == pytest.approx(1.5009765625) and t["acco"] == pytest.approx(2.0)
    # bf16: the fp32 broadcast is M
    assert t["torch-ddp"] == pytest.approx(1 + (1 - 0.25 - 2 / 3) + 0.25 + 1.0)
    assert t["streaming-diloco"] == pytest.approx(1 + 2 * 0.5 / 4)
    acc = bounds(Case(c=1.0, m=0.8, accumulate=True))
    assert acc["acco"] == acc["dpu"] == 1.0 and acc["ddp"] == pytest.approx(1.8)
    # docs/algorithm.md: at W = 2 on the race's 922,880 parameters in fp32, ddp 14.1 MiB, acco 21.1,
    # torch-ddp 10.6, diloco 33.4
    mib = {n: memory_bytes(n, 2, 4) * 922880 / 2**20 for n in ("ddp", "acco", "torch-ddp", "diloco")}
    assert {n: round(v, 1) for n, v in mib.items()} == {"ddp": 14.1, "acco": 21.1, "torch-ddp": 10.6,
                                                         "diloco": 33.4}
    assert memory_bytes("acco-int8", 4, 2) == pytest.approx(6 + 24 / 4 + 2 + 4 / 4)
    # acco.models.flops_per_token of the gptneo-125m / 2.7b configs (meta device), written out here
    assert flops_per_token(**GPT_NEO["125M"], seq=1024) == 855000576
    assert flops_per_token(**GPT_NEO["2.7B"], seq=512) == 16379704320
    times, mem = {"a": 1.0, "b": 1.005, "c": 1.2}, {"a": 10, "b": 5, "c": 1}
    assert winner(times, mem, ["a", "b", "c"]) == "b"  # within 1%: the smaller state
    assert (
        winner(times, mem, ["a", "c"]) == "a"
        and winner(times, mem, ["c"]) == "c"
        and winner(times, mem, []) is None
    )

    bench = {
        "config": {
            "hosts": 2,
            "grad_accum": 4,
            "mixed_precision": False,
            "accumulate_while_waiting": False,
            "network": {"label": "100mbit"},
        },
        "bounds": {"ddp_compute_s": 0.4, "ddp_comm_s": 0.3},
        "methods": {"ddp": {"speedup_step_vs_ddp": 1.0}, "acco": {"speedup_step_vs_ddp": 1.1}},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "map"
    assert main(["map", "--compute-s", "1", "--comm-s", "0.5", "--workers", "2", "--dtype", "fp32",
                 "--grad-accum", "4", "--params", "1e6", "--bench", str(tmp_path / "bench.json"),
                 "--out", str(out)]) == 0
    r = json.loads((out / "map.json").read_text())
    assert r["user"]["time_s"]["ddp"] == pytest.approx(1.5) and r["user"]["winner_follow_ddp"] == "acco"
    row = r["check"][-1]
    assert row["source"].endswith("bench.json") and row["methods"]["acco"]["ratio"] == pytest.approx(
        1.1 / (0.7 / 0.6)
    )
    assert len(r["paper"]) == 9 and all(p["winner_all"] for p in r["paper"])
    md = (out / "map.md").read_text()
    assert (
        "## Your figures" in md
        and "## Assumptions" in md
        and "MFU 0.4" in md
        and md in capsys.readouterr().out
    )
    assert main(["map", "--compute-s", "1"]) == 2  # --comm-s missing


def test_every_acco_variant_against_its_own_bound(tmp_path):
    """cluster's comparisons, its report and map's check give each acco variant the bound of the
    overrides it ran with (estimate round full or int8, fp32 or bf16 on the wire, e of 2k micro-batches
    during the estimate round or split by durations), from ddp's C = 1.0 s and M = 0.8 s per update."""
    from acco_bench.acco_bound import acco_update_time, int8_ratio
    from acco_bench.map import check_rows, from_bench_json
    from acco_bench.report import bench_markdown

    c, m = 1.0, 0.8
    # the other engineer's acco-int8-auto, as the run's overrides of plain acco
    auto = ("train.estimate_comm=int8", "train.estimate_micro_batches=auto")

    def run(methods, **kw):
        settings = BenchSettings(methods=tuple(methods), grad_accum=4, **kw)  # acco: k = 2 per round, 2k = 4
        res = {"ddp": {"step_time_s": c + m, "samples_per_s": 10.0, "compute_s_per_update": c,
                       "comm_s_per_update": m}}
        res.update({n: {"step_time_s": t, "samples_per_s": 10.0 * (c + m) / t} for n, t in methods.items()})
        return settings, res, add_comparisons(res, settings)

    steps = {"acco": 1.7, "acco-lean": 1.7, "acco-int8": 1.4, "acco-int8-e1": 1.2}
    settings, res, out = run(steps)
    est = int8_ratio(4) * m  # fp32 on the wire
    times = {"acco": max(c, 2 * m), "acco-lean": max(c, 2 * m),
             "acco-int8": max(c / 2, est) + max(c / 2, m),  # the even split
             "acco-int8-e1": max(c / 4, est) + max(3 * c / 4, m)}  # e = 1 of 2k = 4
    assert times["acco-int8-e1"] == pytest.approx(1.05)
    for n, t in times.items():
        assert res[n]["bound_speedup"] == pytest.approx((c + m) / t), n
        assert res[n]["fraction_of_bound"] == pytest.approx((c + m) / steps[n] / ((c + m) / t)), n
    assert out["bounds"]["ideal_acco"] == pytest.approx(1.8 / 1.6)  # plain acco's, kept
    assert "fraction_of_ideal_acco" in res["acco"] and "fraction_of_ideal_acco" not in res["acco-int8"]
    assert "bound_speedup" not in res["ddp"]
    bench = {"config": {**settings.describe(), "network": {"label": "100mbit", "note": "x"}, "machine": {}},
             "methods": res, **out}
    md = bench_markdown(bench)
    assert (
        "- acco-int8-e1: 1.50x per update, 0.88 of its bound (C+M)/(max(eC/2k, M_est)+max((2k-e)C/2k, M)) "
        "= 1.71x (e = 1, 2k = 4, M_est = 0.2505 M)."
    ) in md
    assert (
        "- acco-int8: 1.29x per update, 0.93 of its bound (C+M)/(max(C/2, M_est)+max(C/2, M)) = 1.38x" in md
    )
    assert "- acco: 1.06x per update, 0.94 of its bound (C+M)/max(C,2M) = 1.12x." in md
    # map's check reads the same bench.json and gives every variant the same bound
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    row = check_rows(from_bench_json(tmp_path / "bench.json"))[-1]["methods"]
    for n in steps:
        assert row[n]["bound"] == pytest.approx(res[n]["bound_speedup"]) and row[n]["ratio"] == pytest.approx(
            res[n]["fraction_of_bound"]), n

    # bf16 on the wire (mixed precision), the split by durations through the run's overrides
    settings, res, _ = run({"acco": 1.0, "acco-int8-e1": 1.3}, mixed_precision=True, extra=auto)
    est = int8_ratio(2) * m
    assert res["acco"]["bound_speedup"] == pytest.approx((c + m) / max(c, est + m))
    assert res["acco-int8-e1"]["bound_speedup"] == pytest.approx((c + m) / max(c, est + m))  # auto wins: last
    bench = {"config": settings.describe(), "bounds": {"ddp_compute_s": c, "ddp_comm_s": m}, "methods": res}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    row = check_rows(from_bench_json(tmp_path / "bench.json"))[-1]["methods"]
    assert row["acco [int8, auto]"]["bound"] == pytest.approx(res["acco"]["bound_speedup"])
    settings, res, _ = run({"acco-int8-e1": 1.3}, mixed_precision=True)
    assert res["acco-int8-e1"]["bound_speedup"] == pytest.approx(
        (c + m) / (max(c / 4, est) + max(3 * c / 4, m))
    )
    # accumulating: compute never waits, samples/s against (C+M)/C
    _, res, _ = run({"acco-int8-e1": 1.3}, accumulate_while_waiting=True)
    assert res["acco-int8-e1"]["bound_speedup"] == pytest.approx(c + m)
    assert res["acco-int8-e1"]["fraction_of_bound"] == pytest.approx(1.8 / 1.3 / 1.8)
    with pytest.raises(BenchError, match="estimate_micro_batches"):
        acco_update_time(c, m, estimate_comm="int8", split=4, micro_batches=4)


@pytest.mark.parametrize("bf16", [True, False])
def test_the_map_s_memory_is_what_the_engine_holds(bf16):
    """memory_bytes' rows for the decoupled methods are the engine's state_bytes per parameter (one
    worker, a shard small enough that acco's trial workspace is its 4 bytes an element)."""
    import torch
    from torch import nn

    from acco.engine import EngineConfig, build_engine
    from acco_bench.map import memory_bytes

    for method, estimate in (("ddp", {}), ("dpu", {}), ("wp", {}), ("acco", {}),
                             ("acco-int8", {"estimate_comm": "int8"})):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 30))  # 9126 parameters, 3 x 3042
        engine = build_engine(model, EngineConfig(method=method.split("-")[0], use_mixed_precision=bf16,
                                                  nb_steps_tot=4, **estimate))
        p = sum(q.numel() for q in model.parameters())
        held = sum(engine.state_bytes().values()) / p
        engine.close()
        if method == "acco-int8":  # its packed int8 buffers round up to whole blocks
            assert held == pytest.approx(memory_bytes(method, 1, 2 if bf16 else 4), rel=1e-3), method
        else:
            assert held == memory_bytes(method, 1, 2 if bf16 else 4), method


def test_map_from_a_ddp_run_folder_reads_its_figures(tmp_path, capsys):
    """`acco-bench map --from RUN_DIR`: C and M are the medians of a ddp run's compute_s and comm_s
    after its first update (summary.json's per-update figures), with its workers, parameters,
    precision and micro-batches per update; its figures come first and the measured tables only
    with --tables. A folder given to --bench, or a run of another method, is one clear line."""
    import statistics

    from trainer_helpers import tiny_args, tiny_data, tiny_model

    from acco.models import count_parameters
    from acco.trainer import DecoupledTrainer

    run = tmp_path / "ddp"
    model = tiny_model()
    args = tiny_args("ddp", run, nb_steps_tot=16, save_step=0)
    summary = DecoupledTrainer(model=model, train_dataset=tiny_data(), args=args).train()
    capsys.readouterr()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = [u for u in lines if u["type"] == "train"][1:]
    median = {k: statistics.median(u[k] for u in steady) for k in ("compute_s", "comm_s")}
    assert median == {"compute_s": summary["compute_s_per_update"], "comm_s": summary["comm_s_per_update"]}

    out = tmp_path / "map"
    assert main(["map", "--from", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    user = json.loads((out / "map.json").read_text())["user"]
    params = count_parameters(model)
    assert user["from_run"] == {"run_dir": str(run), "updates": 8, "workers": 1, **median, "params": params,
                                "dtype": "fp32", "grad_accum": 2}  # fmt: skip
    case = user["case"]
    assert (case["c"], case["m"], case["workers"], case["elem_bytes"], case["grad_accum"]) == (
        median["compute_s"], median["comm_s"], 1, 4, 2)
    assert printed.index("## Your figures") < printed.index("## Assumptions")
    assert "## Bounds against the measured" not in printed and "paper's settings: --tables" in printed
    assert main(["map", "--from", str(run), "--tables", "--workers", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.index("## Your figures") < printed.index("## Bounds against the measured speedups")
    assert "(ddp, 1 workers, 8 updates)" in printed and "| ddp | " in printed

    for argv, said in (
        (["--bench", str(run)], f"--bench {run} is a folder with no bench.json or sweep.json: --bench takes "
                                "acco-bench cluster's bench.json or sweep's sweep.json (a training run's "
                                "folder: --from)"),
        (["--from", str(tmp_path)], f"--from {tmp_path}: no metrics.jsonl: not the folder of a training run"),
        (["--from", str(run), "--compute-s", "1", "--comm-s", "1"], "--from reads C and M from the run"),
    ):  # fmt: skip
        assert main(["map", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"acco-bench: {said}") and err.count("\n") == 1, err
    (run / "summary.json").write_text(json.dumps({**summary, "method": "acco"}))  # as an acco run's says
    assert main(["map", "--from", str(run)]) == 2
    assert capsys.readouterr().err.startswith(f"acco-bench: --from {run}: the run is acco's; the bounds")
