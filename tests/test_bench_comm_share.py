"""``--comm-share``: the rate computed from ddp's compute and comm (hand-computed cases), the
calibration's steps on a simulated link, the flags' errors, and (slow, on namespaces) that the
share measured in a real run lands within 0.05 of the one asked."""

from __future__ import annotations

import json
import os

import pytest

from acco_bench import BenchError, comm_share
from acco_bench.cli import main
from acco_bench.network import namespaces, parse_rate

REASON = namespaces.netns_unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def test_comm_for_a_share():
    # M / (C + M) = S  <=>  M = S / (1 - S) C
    assert comm_share.comm_for_share(0.6, 0.4) == pytest.approx(0.4)
    assert comm_share.comm_for_share(0.3, 0.5) == pytest.approx(0.3)
    assert comm_share.comm_for_share(0.9, 0.25) == pytest.approx(0.3)
    assert comm_share.share_of(0.6, 0.4) == pytest.approx(0.4)
    assert comm_share.share_of(None, 0.4) is None
    for bad in (0, 1, 1.5, -0.2):
        with pytest.raises(BenchError, match="between 0 and 1"):
            comm_share.comm_for_share(0.5, bad)


def test_rate_for_a_share_by_hand():
    # C 0.6 s, S 0.4: M 0.4 s; 16 Mbit per update, nothing fixed: 40 Mbit/s
    assert comm_share.rate_for_share(0.6, 0.4, 16e6) == pytest.approx(40e6)
    # C 0.3 s, S 0.5: M 0.3 s, of which 0.1 s does not shrink with the rate: 8 Mbit in 0.2 s
    assert comm_share.rate_for_share(0.3, 0.5, 8e6, fixed_s=0.1) == pytest.approx(40e6)
    # C 0.9 s, S 0.25: M 0.3 s; 4.4 MB fp32 ring on 2 hosts, 2 (W-1)/W N 4 bytes = 35.2 Mbit: 117.3 Mbit/s
    assert comm_share.rate_for_share(0.9, 0.25, 2 * 0.5 * 1.1e6 * 4 * 8) == pytest.approx(35.2e6 / 0.3)
    # unshaped comm already above the share asked: out of reach, said in one line
    with pytest.raises(BenchError, match="out of reach"):
        comm_share.rate_for_share(1.0, 0.1, 8e6, fixed_s=0.2)


def test_the_fitted_bits_and_the_tc_rate():
    # M0 0.05 s unshaped, 0.45 s at 50 Mbit/s: 0.4 s of it is the bytes at 50 Mbit/s = 20 Mbit
    assert comm_share.fitted_bits(0.05, 50e6, 0.45, 1.0) == pytest.approx(20e6)
    assert comm_share.fitted_bits(0.05, 50e6, 0.04, 7e6) == 7e6  # not above M0: the bytes counted
    assert comm_share.tc_rate(40e6) == "40000kbit" and parse_rate("40000kbit") == 40e6
    assert comm_share.tc_rate(123_456_789) == "123457kbit"
    assert comm_share.rate_label("40000kbit") == "40.0 Mbit/s" and comm_share.rate_label(None) == "unshaped"


class _FakeNet:
    cluster = object()  # emulated hosts

    def __init__(self):
        self.rates = []

    def set_bandwidth(self, rate):
        self.rates.append(rate)


def test_calibration_on_a_simulated_link(monkeypatch, tmp_path):
    """A link where M(R) = M0 + b/R, b 12 Mbit (not the 10 Mbit counted), compute 0.50 s unshaped and
    0.55 s under shaped traffic: the rate chosen puts ddp's comm at exactly S of its step at their
    mean, 0.525 s."""
    m0, bits, share = 0.03, 12e6, 0.4

    def fake_probe(settings, net, bandwidth, out, log=print):
        net.set_bandwidth(bandwidth)
        if bandwidth is None:
            return {"bandwidth": None, "compute_s": 0.50, "comm_s": m0, "bytes_per_update": 10e6 / 8}
        return {"bandwidth": bandwidth, "compute_s": 0.55, "comm_s": m0 + bits / parse_rate(bandwidth)}

    monkeypatch.setattr(comm_share, "probe", fake_probe)
    net = _FakeNet()
    cal = comm_share.calibrate(None, net, share, tmp_path, log=lambda *a: None)
    first = 10e6 / (0.4 / 0.6 * 0.50 - m0)  # from the unshaped probe and the bytes counted
    assert net.rates[:2] == [None, comm_share.tc_rate(first)]
    want = bits / (0.4 / 0.6 * 0.525 - m0)  # b fitted from the shaped probe, C the probes' mean
    assert net.rates[-1] == cal["rate"] == comm_share.tc_rate(want)
    assert len(cal["probes"]) == 1  # 0.50 and 0.55 s agree within 15%: no third probe
    assert cal["bits_per_update_fitted"] == pytest.approx(bits, rel=1e-4)
    rate = parse_rate(cal["rate"])
    assert comm_share.share_of(0.525, m0 + bits / rate) == pytest.approx(share, abs=1e-4)
    # an unshaped probe from an earlier calibration (a sweep's) is not run again
    net2 = _FakeNet()
    comm_share.calibrate(None, net2, 0.3, tmp_path, log=lambda *a: None, unshaped=cal["unshaped"])
    assert None not in net2.rates


def test_a_probe_runs_ddp_alone_for_the_probe_updates():
    from acco_bench.settings import BenchSettings

    asked = BenchSettings(probe_updates=5, grad_accum=6, hosts=2, eval_step=2)
    s = comm_share._probe_settings(asked, "9mbit")
    assert s.methods == ("ddp",) and s.bandwidth == "9mbit" and s.comm_share is None and s.eval_step is None
    assert s.nb_steps_tot == 5 * 6 * 2 and "train.max_eval_batches=1" in s.extra
    with pytest.raises(BenchError, match="probe_updates must be >= 3"):
        BenchSettings(probe_updates=2).validate()


def test_the_share_line_names_the_share_first():
    asked = comm_share.share_fields(0.4, 0.41, "80000kbit")
    assert asked["rate_mbit_s"] == 80.0
    line = comm_share.share_line(asked)
    assert line.index("0.40") < line.index("0.41") < line.index("80.0 Mbit/s")
    line = comm_share.share_line(comm_share.share_fields(None, 0.43, "100mbit"))
    assert "0.43" in line and "--bandwidth" in line and "100.0 Mbit/s" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["cluster", "--bandwidth", "100mbit", "--comm-share", "0.4"],
        ["race", "--comm-share", "0.4", "--bandwidth", "200mbit"],
        ["sweep", "--bandwidths", "50mbit", "--comm-shares", "0.3,0.45"],
    ],
)
def test_a_rate_and_a_share_exclude_each_other(argv, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exclude each other" in err[0], err


def test_bad_shares_fail_with_one_line(tmp_path, capsys):
    assert main(["cluster", "--loopback", "--comm-share", "1.2", "--out", str(tmp_path)]) == 2
    assert "between 0 and 1" in capsys.readouterr().err
    assert main(["race", "--loopback", "--comm-share", "0.4", "--out", str(tmp_path)]) == 2
    assert "needs emulated hosts" in capsys.readouterr().err
    assert main(["sweep", "--loopback", "--comm-shares", "0.3,0.6", "--out", str(tmp_path)]) == 2
    assert "needs emulated hosts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", "--comm-shares", "0.3,half"])
    assert "--comm-shares takes numbers" in capsys.readouterr().err


def test_the_demo_refuses_a_rate_and_a_share(capsys):
    from acco_bench import demo

    assert demo.main(["--bandwidth", "100mbit", "--comm-share", "0.4"]) == 2
    assert "exclude each other" in capsys.readouterr().err


@needs_netns
@pytest.mark.slow
def test_the_share_measured_lands_near_the_one_asked(tmp_path):
    """The calibration (two short ddp runs) then a ddp run of the benchmark's own model at the rate
    chosen. What the calibration controls is the comm at that rate: within 15% of its prediction.
    The share also moves with the compute, which other load on the cores changes between the
    calibration and the run (seen: 1.88 s then 1.38 s per update), so it gets a looser bound here;
    on a quiet machine it lands within 0.05 (BENCHMARKS.md, "Time to the same loss")."""
    out = tmp_path / "cluster"
    argv = ["cluster", "--comm-share", "0.4", "--methods", "ddp", "--nb-steps-tot", "160",
            "--retry-disturbed", "0", "--timeout", "300", "--out", str(out)]
    assert main(argv) == 0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["comm_share_asked"] == 0.4 and bench["rate"] == bench["config"]["network"]["bandwidth"]
    assert bench["calibration"]["probes"] and bench["calibration"]["unshaped"]["bandwidth"] is None
    cal = bench["calibration"]
    predicted = cal["fixed_comm_s"] + cal["bits_per_update_fitted"] / parse_rate(bench["rate"])
    measured = bench["methods"]["ddp"]["comm_s_per_update"]
    assert abs(measured - predicted) <= 0.15 * predicted, (measured, predicted, cal)
    assert abs(bench["comm_share_measured"] - 0.4) <= 0.15, cal
    assert "asked **0.40**" in (out / "bench.md").read_text()
    assert namespaces.list_namespaces(f"{namespaces.DEFAULT_PREFIX}{os.getpid()}-") == []


def test_the_share_line_says_what_was_measured_and_on_which_link():
    share_line = comm_share.share_line
    none = {"comm_share_measured": None, "comm_share_asked": None, "rate": None}
    head = "Comm share (ddp's comm over its step):"
    loopback = f"{head} not measured (no ddp run); rate none: loopback, no link emulated."
    assert share_line(none, loopback=True) == loopback
    assert share_line({**none, "comm_share_measured": 0.31, "rate": "100mbit"}) == (
        "Comm share (ddp's comm over its step): measured **0.31**; rate 100.0 Mbit/s (set by --bandwidth)."
    )
    assert share_line({**none, "comm_share_asked": 0.3, "rate": "100mbit"}).startswith(
        "Comm share (ddp's comm over its step): asked **0.30**, not measured (no ddp run); rate 100.0 Mbit/s"
    )
