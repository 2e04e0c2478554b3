"""acco-bench on emulated nodes: --nodes R --workers-per-node S (one namespace per node, its workers
unshaped inside it), the X-nodes method names (train.rounds=nodes; X itself the flat ring), each
worker's layout variables, the bytes on the node links per update, and the map's flat ring against
the two-level rounds; a tiny race on 2 x 2 in the slow tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco.config import compose
from acco.engine.nodes import NodeLayout, workers_per_node_from_env
from acco.job import job_of
from acco_bench import BenchError, race
from acco_bench.analysis import add_comparisons, node_link_fields
from acco_bench.cli import _settings, build_parser, main
from acco_bench.map import check_rows, from_bench_json
from acco_bench.map_bounds import Case, bounds, round_comm, slow_link_share, speedups, two_level
from acco_bench.network import Network, namespaces
from acco_bench.settings import BenchSettings, base_method, check_methods, method_overrides
from acco_bench.workers import layout_env, run_workers

# --------------------------------------------------------------------------------------------
# the flags


@pytest.mark.parametrize("command", ["race", "cluster", "sweep"])
def test_nodes_and_workers_per_node_make_the_layout(command):
    def layout(*flags):
        s = _settings(build_parser().parse_args([command, *flags]))
        return s.hosts, s.workers_per_node, s.workers

    assert layout("--nodes", "2", "--workers-per-node", "3") == (2, 3, 6)
    assert layout("--hosts", "3") == (3, 1, 3)  # today's layout: one worker per host
    assert layout("--nodes", "4") == (4, 1, 4)
    assert layout("--workers-per-node", "2") == (BenchSettings().hosts, 2, 2 * BenchSettings().hosts)
    assert layout() == (BenchSettings().hosts, 1, BenchSettings().hosts)


def test_the_race_budget_scales_with_the_workers():
    # as many micro-batches per worker (so as many updates, and DiLoCo syncs) at 4 workers as at 2
    budget = lambda *flags: _settings(build_parser().parse_args(["race", *flags])).nb_steps_tot  # noqa: E731
    assert budget("--hosts", "2") == 480
    assert budget("--hosts", "4") == budget("--nodes", "2", "--workers-per-node", "2") == 960
    assert budget("--hosts", "4", "--nb-steps-tot", "100") == 100  # given: as given


@pytest.mark.parametrize("flags", [["--hosts", "2", "--nodes", "2"],
                                   ["--hosts", "4", "--workers-per-node", "2"]])
def test_hosts_and_nodes_exclude_each_other(flags, tmp_path, capsys):
    for command in ("race", "cluster"):
        assert main([command, "--loopback", *flags, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--hosts" in err and "--nodes" in err, err


def test_worker_threads_and_slow_worker_count_every_worker():
    s = BenchSettings(hosts=2, workers_per_node=2)
    assert s.worker_threads() == max(1, (os.cpu_count() or 1) // 4)
    assert s.describe()["workers"] == 4 and s.describe()["workers_per_node"] == 2
    BenchSettings(hosts=2, workers_per_node=2, slow_worker=(3, 2.0), methods=("ddp",)).validate()
    with pytest.raises(BenchError, match="rank 4 is not one of the 4 workers"):
        BenchSettings(hosts=2, workers_per_node=2, slow_worker=(4, 2.0), methods=("ddp",)).validate()


# --------------------------------------------------------------------------------------------
# the method names


def test_nodes_names_run_their_method_with_the_two_level_rounds():
    assert base_method("acco-int8-auto-nodes") == "acco" and base_method("diloco-h10-nodes") == "diloco"
    assert method_overrides("acco-int8-auto-nodes") == (
        "train.estimate_comm=int8", "train.estimate_micro_batches=auto", "train.rounds=nodes")
    assert method_overrides("acco-int8-auto") == (
        "train.estimate_comm=int8", "train.estimate_micro_batches=auto", "train.rounds=flat")
    assert method_overrides("ddp") == ("train.rounds=flat",)
    assert method_overrides("ddp-nodes") == ("train.rounds=nodes",)
    # torch's methods take no train.rounds; torch-hsdp is its own train config, like torch-ddp
    assert method_overrides("torch-ddp") == () and method_overrides("torch-hsdp") == ()
    o = BenchSettings().overrides("torch-hsdp", Path("out"), 0)
    assert o[0] == "train=torch-hsdp" and not any("rounds" in x for x in o)
    check_methods(("ddp", "ddp-nodes", "acco-int8-auto-nodes", "torch-hsdp", "streaming-diloco-h8-nodes"))
    with pytest.raises(BenchError, match="no two-level rounds"):
        check_methods(("ddp", "torch-ddp-nodes"))
    with pytest.raises(BenchError, match="unknown method"):
        check_methods(("adam-nodes",))
    # sharded inside the node: its rounds run between nodes, so only as NAME-nodes
    assert method_overrides("acco-sharded-nodes") == ("train.shard_inside_node=true", "train.rounds=nodes")
    check_methods(("ddp-sharded-nodes", "acco-int8-auto-sharded-nodes"))
    with pytest.raises(BenchError, match="name it acco-sharded-nodes"):
        check_methods(("acco-sharded",))


@pytest.mark.parametrize("method", ["ddp-nodes", "acco-int8-auto-nodes", "acco-int8-auto", "dpu-nodes",
                                    "acco-sharded-nodes"])
def test_a_nodes_method_makes_a_valid_job_with_its_rounds(method, tmp_path):
    s = BenchSettings(hosts=2, workers_per_node=2, methods=(method,))
    s.validate()  # composes every method's workers' config
    job = job_of(compose(s.overrides(method, tmp_path, rank=0)), world_size=4)
    assert job.args.rounds == ("nodes" if method.endswith("-nodes") else "flat")
    assert job.args.method_name == base_method(method)
    if "int8-auto" in method:
        assert job.args.estimate_comm == "int8" and job.args.estimate_micro_batches == "auto"
    assert job.args.shard_inside_node == ("sharded" in method)


def test_a_nodes_method_needs_two_nodes_of_two_workers(tmp_path, capsys):
    for hosts, per_node in ((2, 1), (1, 4)):
        with pytest.raises(BenchError, match="needs --nodes >= 2 and --workers-per-node >= 2"):
            BenchSettings(hosts=hosts, workers_per_node=per_node, methods=("ddp", "ddp-nodes")).validate()
    assert main(["race", "--loopback", "--methods", "ddp,ddp-nodes", "--out", str(tmp_path)]) == 2
    assert "needs --nodes >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's own line
        main(["race", "--loopback", "--methods", "ddp,torch-ddp-nodes", "--out", str(tmp_path)])
    assert "torch-ddp-nodes: no two-level rounds" in capsys.readouterr().err


def test_a_nodes_method_races_with_its_methods_settings():
    s = BenchSettings(hosts=2, workers_per_node=2)
    for method in ("diloco", "diloco-nodes"):
        mine = race.race_overrides(s, 400, "constant", 8, 3.25, method)
        assert "train.sync_every=10" in mine and "train.stop_at_eval_loss=3.25" in mine
    cfg = race._race_config(s, ["ddp", "ddp-nodes", "streaming-diloco-nodes"], "constant", 8, {})
    assert cfg["method_settings"] == {"streaming-diloco-nodes": race.RACE_METHOD_DEFAULTS["streaming-diloco"]}
    assert cfg["workers_per_node"] == 2 and cfg["workers"] == 4


# --------------------------------------------------------------------------------------------
# the plan: which namespace, which variables


def test_every_worker_gets_its_place_in_the_layout(monkeypatch):
    net = Network(2, None, None, loopback=True, workers_per_node=3)
    for rank in range(6):
        env = layout_env(rank, 2, 3)
        assert env == {"RANK": str(rank), "WORLD_SIZE": "6", "LOCAL_RANK": str(rank % 3),
                       "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": str(rank // 3), "ACCO_WORKERS_PER_NODE": "3"}
        assert net.node_of(rank) == rank // 3 == NodeLayout(2, 3, rank).node  # the engine's own order
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert workers_per_node_from_env(6) == 3  # what the engine reads
    with pytest.raises(IndexError):
        net.node_of(6)
    with pytest.raises(ValueError):
        layout_env(6, 2, 3)
    assert layout_env(1, 2, 1)["LOCAL_RANK"] == "0" and layout_env(1, 2, 1)["ACCO_WORKERS_PER_NODE"] == "1"


class _RecordingNet:
    """A Network that records where run_workers starts each worker, and starts a do-nothing process."""

    def __init__(self, workers_per_node: int):
        self.placed: list[tuple[int, dict]] = []
        self.layout = Network(2, None, None, loopback=True, workers_per_node=workers_per_node)

    def master(self):
        return "10.77.1.1", 29999

    def network_procs(self):
        return []

    def popen(self, rank, argv, env, log, sched_batch=False):
        self.placed.append((self.layout.node_of(rank), env))
        return subprocess.Popen([sys.executable, "-c", "pass"], stdout=log, stderr=subprocess.STDOUT)


def test_run_workers_starts_S_workers_per_node_with_their_variables(tmp_path):
    net = _RecordingNet(workers_per_node=2)
    run_workers(BenchSettings(hosts=2, workers_per_node=2, timeout_s=60), "ddp-nodes", tmp_path / "run", net)
    assert [node for node, _ in net.placed] == [0, 0, 1, 1]
    for rank, (_, env) in enumerate(net.placed):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == str(rank % 2)
        assert env["ACCO_WORKERS_PER_NODE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "10.77.1.1" and env["MASTER_PORT"] == "29999"
    assert "train.rounds=nodes" in (tmp_path / "run" / "command.txt").read_text()


def test_node_link_bytes_per_update_and_per_node():
    assert node_link_fields([3000, 1000], 4) == {
        "node_link_bytes": [3000, 1000], "node_link_bytes_per_update": 1000.0,
        "node_link_bytes_per_node_per_update": 500.0}
    assert node_link_fields(None, 4)["node_link_bytes_per_update"] is None  # loopback: no link
    assert node_link_fields([10, 10], 0)["node_link_bytes_per_node_per_update"] is None


# --------------------------------------------------------------------------------------------
# the map and the bounds


def test_the_slow_link_carries_R_minus_1_over_R_with_the_two_level_rounds():
    assert slow_link_share(8, 4, "flat") == pytest.approx(7 / 8)
    assert slow_link_share(8, 4, "nodes") == pytest.approx(1 / 2)
    assert slow_link_share(4, 2, "nodes") / slow_link_share(4, 2, "flat") == pytest.approx(2 / 3)
    assert slow_link_share(8, 1, "nodes") == slow_link_share(8, 1, "flat") == pytest.approx(7 / 8)
    assert slow_link_share(4, 4, "flat") == 0.0  # one node: no slow link
    k = Case(c=1.0, m=0.7, workers=4, workers_per_node=2, latency_s=0.1)
    m, lat = round_comm(two_level(k))
    assert lat == pytest.approx(0.1 * 1 / 3) and m == pytest.approx(0.6 * 2 / 3 + 0.1 / 3)
    assert round_comm(k) == (0.7, 0.1)  # the flat ring: ddp's own M
    flat, nodes = bounds(k), bounds(two_level(k))
    assert nodes["ddp"] == pytest.approx(1.0 + m) and flat["ddp"] == pytest.approx(1.7)
    assert nodes["torch-ddp"] == flat["torch-ddp"]  # torch's all-reduce has no two-level form
    assert nodes["acco"] == pytest.approx(max(1.0, 2 * m))
    assert speedups(two_level(k))["ddp"] == pytest.approx(1.7 / (1.0 + m))  # over the flat ddp
    assert bounds(Case(c=1.0, m=0.7, workers=4, workers_per_node=1, rounds="nodes")) == pytest.approx(flat)


def test_map_workers_per_node_prints_both_layouts(tmp_path, capsys):
    out = tmp_path / "map"
    assert main(["map", "--compute-s", "0.4", "--comm-s", "0.35", "--workers", "8", "--workers-per-node", "4",
                 "--params", "1e6", "--dtype", "fp32", "--out", str(out)]) == 0
    u = json.loads((out / "map.json").read_text())["user"]
    n = u["nodes"]
    assert n["nodes"] == 2 and n["slow_link_share"] == pytest.approx({"flat": 7 / 8, "nodes": 1 / 2})
    assert n["slow_link_bytes_per_collective"] == pytest.approx({"flat": 3.5e6, "nodes": 2e6})  # 4 B/param
    assert n["comm_s"] == pytest.approx(0.35 * (1 / 2) / (7 / 8))
    assert n["time_s"]["ddp"] == pytest.approx(0.4 + 0.2) and "torch-ddp" not in n["time_s"]
    assert u["time_s"]["ddp"] == pytest.approx(0.75)  # the flat ring's bounds stay as they were
    md = (out / "map.md").read_text()
    assert "## Flat ring against two-level rounds" in md and "(R-1)/R = 0.500" in md
    capsys.readouterr()
    for flags in (["--workers", "8", "--workers-per-node", "3"],
                  ["--workers", "4", "--workers-per-node", "4"]):
        assert main(["map", "--compute-s", "0.4", "--comm-s", "0.3", *flags]) == 2
        assert "into 2 nodes or more" in capsys.readouterr().err
    assert main(["map", "--workers", "8", "--workers-per-node", "4"]) == 2  # no figures to scale
    assert "--compute-s" in capsys.readouterr().err


def test_a_nodes_bench_is_checked_against_the_two_level_bounds(tmp_path):
    c, m = 0.4, 0.3
    bench = {
        "config": {"hosts": 2, "workers_per_node": 2, "grad_accum": 4, "mixed_precision": False,
                   "accumulate_while_waiting": False, "network": {"label": "100mbit"}},
        "bounds": {"ddp_compute_s": c, "ddp_comm_s": m},
        "methods": {"ddp": {"speedup_step_vs_ddp": 1.0}, "ddp-nodes": {"speedup_step_vs_ddp": 1.1},
                    "dpu": {"speedup_step_vs_ddp": 1.3}, "dpu-nodes": {"speedup_step_vs_ddp": 1.5}},
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    flat_row, nodes_row = check_rows(from_bench_json(tmp_path / "bench.json"))[-2:]
    assert "two-level" not in flat_row["source"] and nodes_row["source"].endswith("(two-level rounds)")
    assert set(flat_row["methods"]) == {"dpu"} and set(nodes_row["methods"]) == {"ddp", "dpu"}
    m2 = m * (1 / 2) / (3 / 4)
    assert nodes_row["methods"]["ddp"]["bound"] == pytest.approx((c + m) / (c + m2))
    assert nodes_row["methods"]["dpu"]["bound"] == pytest.approx((c + m) / max(c, m2))
    assert flat_row["methods"]["dpu"]["bound"] == pytest.approx((c + m) / max(c, m))


def test_cluster_gives_an_acco_nodes_method_its_two_level_bound():
    c, m = 0.4, 0.5
    settings = BenchSettings(hosts=2, workers_per_node=2, methods=("ddp", "acco", "acco-nodes"))
    res = {"ddp": {"step_time_s": c + m, "samples_per_s": 10.0, "compute_s_per_update": c,
                   "comm_s_per_update": m},
           "acco": {"step_time_s": 1.0, "samples_per_s": 9.0},
           "acco-nodes": {"step_time_s": 0.8, "samples_per_s": 11.0}}
    add_comparisons(res, settings)
    assert res["acco"]["bound_speedup"] == pytest.approx((c + m) / max(c, 2 * m))
    assert res["acco-nodes"]["bound_speedup"] == pytest.approx((c + m) / max(c, 2 * m * 2 / 3))


# --------------------------------------------------------------------------------------------
# a tiny race on 2 nodes of 2 workers


TINY_NODES = [
    "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--batch-size", "4", "--max-length", "32",
    "--grad-accum", "2", "--timeout", "150", "--eval-batches", "2", "--override", "data.n_docs=300",
    "--override", "model.vocab_size=512", "--retry-disturbed", "0",
    # 30 updates of ddp, evaluated every 5: what a run sends once (the rendezvous, rank 0's initial
    # weights) is about 4 payloads, a seventh of an update's share here
    "--nb-steps-tot", "240", "--eval-step", "5",
]  # fmt: skip


@pytest.mark.skipif(namespaces.netns_unavailable_reason() is not None, reason="no network namespaces")
@pytest.mark.slow
def test_race_on_two_nodes_of_two_workers_measures_the_node_links(tmp_path):
    """ddp (the flat ring over 4 workers) and ddp-nodes (the two-level rounds) on 2 namespaces of 2
    workers: the bytes through the node links are measured, and the two-level rounds send (R-1)/R
    against (W-1)/W of the payload there, 0.67 by count: at most 0.70 per update, the run's fixed
    traffic included."""
    out = tmp_path / "race"
    assert main(["race", "--nodes", "2", "--workers-per-node", "2", "--methods", "ddp,ddp-nodes",
                 "--bandwidth", "1000mbit", "--out", str(out), *TINY_NODES]) == 0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["config"]["workers"] == 4 and bench["config"]["network"]["kind"] == "netns"
    per_update = {}
    for name in ("ddp", "ddp-nodes"):
        r = bench["methods"][name]
        assert "error" not in r, r.get("error")
        sent = r["node_link_bytes"]
        assert len(sent) == 2 and all(b > 0 for b in sent), sent  # one link per node
        assert r["node_link_bytes_per_update"] == pytest.approx(sum(sent) / r["updates"])
        assert r["node_link_bytes_per_node_per_update"] == pytest.approx(sum(sent) / r["updates"] / 2)
        assert r["bytes_sent_per_worker"] is None  # 2 workers share each link
        per_update[name] = r["node_link_bytes_per_update"]
    assert "train.rounds=flat" in (out / "ddp" / "command.txt").read_text()
    assert "train.rounds=nodes" in (out / "ddp-nodes" / "command.txt").read_text()
    ratio = per_update["ddp-nodes"] / per_update["ddp"]
    assert 0.6 < ratio <= 0.70, ratio
    md = (out / "race.md").read_text()
    assert "2 nodes x 2 workers" in md and "node link MiB per update" in md and "| ddp-nodes |" in md
    assert namespaces.list_namespaces(f"{namespaces.DEFAULT_PREFIX}{os.getpid()}-") == []
