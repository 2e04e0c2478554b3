"""``--comm-share S``: the link rate at which ddp spends the fraction S of its step communicating,
measured on this machine, so that a figure means the same on a faster or a slower CPU.

ddp's step is C + M (compute and comm per update), so a share S needs M = S/(1-S) C. M is the
bytes of ddp's round over the link's rate plus what does not shrink with the rate (gloo's own work
and the latency): M(R) = M0 + b/R. :func:`calibrate` measures both, on the emulated hosts the run
then uses, right before it (a shared machine's speed drifts):

1. a short ddp run (``BenchSettings.probe_updates`` updates, the run's model, batch and threads) on
   unshaped links: its compute C0, its comm M0 and the bytes each host sent per update (tx counters);
2. a first rate from those, R1 = 8 bytes / (S/(1-S) C0 - M0) (:func:`rate_for_share`);
3. a short ddp run at R1: C1 and M1 measured, b = (M1 - M0) R1 (:func:`fitted_bits`: the ring's
   bytes as the link carries them, headers and all), and the rate R = b / (S/(1-S) C - M0), C the
   mean of C0 and C1: this machine's compute measured twice in the minute before the run (on a
   shared machine one short run's compute is off by up to a third: measured 2.39 s, then 3.10 s,
   then 2.45 s in the run itself, while the comm came within 1% of M0 + b/R);
4. where C0 and C1 differ by more than :data:`PROBE_SPREAD` (measured: 18-61% on a VM whose speed
   moved, against 0-10% on a steady one), a third run at R measures C2, and C is the median of the
   three: one probe on a slow or fast spell no longer sets the rate alone.

The run reports the share it measured, ddp's M / (C + M) with the medians of
:func:`acco_bench.analysis.method_metrics` (slowest worker's compute, smallest comm), beside the
share asked and the rate (``comm_share_asked``, ``comm_share_measured``, ``rate`` in every JSON).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import replace
from pathlib import Path

from acco_bench import BenchError
from acco_bench.network import parse_rate

PROBE_SPREAD = 0.15  # the probes' compute this far apart (relative): a third probe, and their median


def check_share(share: float) -> None:
    if not 0 < share < 1:
        raise BenchError(f"--comm-share must be between 0 and 1 (ddp's comm over its step), got {share:g}")


def comm_for_share(compute_s: float, share: float) -> float:
    """ddp's comm per update that makes it ``share`` of ddp's step: S/(1-S) C."""
    check_share(share)
    return share / (1 - share) * compute_s


def rate_for_share(compute_s: float, share: float, bits_per_update: float, fixed_s: float = 0.0) -> float:
    """The link rate (bit/s) at which M0 + b/R = S/(1-S) C: ``fixed_s`` is M0, the comm that does not
    shrink with the rate (ddp's comm on unshaped links), ``bits_per_update`` is b."""
    m = comm_for_share(compute_s, share)
    if m <= fixed_s:
        raise BenchError(
            f"a comm share of {share:g} is out of reach here: on unshaped links ddp already spends "
            f"{share_of(compute_s, fixed_s):.2f} of its step communicating ({fixed_s:.3f} s per update)"
        )
    if bits_per_update <= 0:
        raise BenchError("no bytes sent per update: cannot compute a rate")
    return bits_per_update / (m - fixed_s)


def fitted_bits(m0: float, rate_bps: float, m1: float, fallback_bits: float) -> float:
    """b in M(R) = M0 + b/R from ddp's comm ``m1`` measured at ``rate_bps`` (``fallback_bits``, the
    bytes counted, where the measured comm is not above M0)."""
    return (m1 - m0) * rate_bps if m1 > m0 else fallback_bits


def share_of(compute_s: float | None, comm_s: float | None) -> float | None:
    """ddp's comm share, M / (C + M)."""
    if compute_s is None or comm_s is None or compute_s + comm_s <= 0:
        return None
    return comm_s / (compute_s + comm_s)


def tc_rate(bps: float) -> str:
    """A rate in bit/s as ``tc`` takes it, to the kbit."""
    return f"{max(1, round(bps / 1e3))}kbit"


def rate_label(rate: str | None) -> str:
    return "unshaped" if rate is None else f"{parse_rate(rate) / 1e6:.1f} Mbit/s"


def ddp_share(methods: dict) -> float | None:
    """The share measured in a run: from ddp's compute and comm per update (None without ddp)."""
    ddp = methods.get("ddp") or {}
    if "error" in ddp:
        return None
    return share_of(ddp.get("compute_s_per_update"), ddp.get("comm_s_per_update"))


def share_fields(asked: float | None, measured: float | None, rate: str | None,
                 calibration: dict | None = None) -> dict:
    """The keys every output JSON gets (``calibration``: how the rate was found, when asked)."""
    d = {"comm_share_asked": asked, "comm_share_measured": measured, "rate": rate,
         "rate_mbit_s": parse_rate(rate) / 1e6 if rate else None}
    if calibration is not None:
        d["calibration"] = calibration
    return d


def share_line(d: dict, loopback: bool = False) -> str:
    """One Markdown line: the share asked and measured, then the rate."""
    measured, asked = d.get("comm_share_measured"), d.get("comm_share_asked")
    got = f"measured **{measured:.2f}**" if measured is not None else "not measured (no ddp run)"
    rate = rate_label(d.get("rate"))
    if asked is None:
        how = "none: loopback, no link emulated" if loopback else f"{rate} (set by --bandwidth)"
        return f"Comm share (ddp's comm over its step): {got}; rate {how}."
    cal = d.get("calibration") or {}
    how = ""
    if cal.get("unshaped") and cal.get("probes"):
        u, p = cal["unshaped"], cal["probes"][-1]
        how = (f" (calibrated here: ddp unshaped C {u['compute_s']:.3f} s, M {u['comm_s']:.3f} s; at "
               f"{rate_label(p['bandwidth'])} C {p['compute_s']:.3f} s, M {p['comm_s']:.3f} s)")
    head = "Comm share (ddp's comm over its step)"
    return f"{head}: asked **{asked:.2f}**, {got}; rate {rate}{how}."


def _probe_settings(settings, bandwidth: str | None):
    extra = tuple(settings.extra)
    if not any(o.split("=", 1)[0].lstrip("+~") == "train.max_eval_batches" for o in extra):
        extra += ("train.max_eval_batches=1",)  # only the final evaluation, and a short one
    return replace(settings, methods=("ddp",), bandwidth=bandwidth, comm_share=None, eval_step=None,
                   nb_steps_tot=settings.probe_updates * settings.grad_accum * settings.workers, extra=extra,
                   repeats=1)


def probe(settings, net, bandwidth: str | None, out: Path, log=print, name: str | None = None) -> dict:
    """A short ddp run on ``net`` with its links at ``bandwidth`` (None: unshaped): C, M, bytes.
    ``name``: its folder under ``out`` (default: the rate, or ``unshaped``)."""
    from acco_bench.analysis import method_metrics
    from acco_bench.drift import compute_per_micro_batch
    from acco_bench.workers import LoadMeter, run_workers

    net.set_bandwidth(bandwidth)
    s = _probe_settings(settings, bandwidth)
    run_dir = out / (name or ("unshaped" if bandwidth is None else bandwidth))
    if run_dir.exists():  # the trainer appends to metrics.jsonl: start clean
        shutil.rmtree(run_dir)
    load = LoadMeter()
    before = net.tx_bytes()
    run_workers(s, "ddp", run_dir, net, load)
    after = net.tx_bytes()
    m = method_metrics(run_dir, s)
    sent = statistics.fmean(b - a for a, b in zip(before, after))
    res = {"bandwidth": bandwidth, "compute_s": m["compute_s_per_update"], "comm_s": m["comm_s_per_update"],
           "share": share_of(m["compute_s_per_update"], m["comm_s_per_update"]), "updates": m["updates"],
           "bytes_per_update": sent / m["updates"], "other_cpu_cores": load.result().get("other_cpu_cores"),
           "compute_s_per_micro_batch": compute_per_micro_batch(run_dir),
           "run_dir": str(run_dir)}
    log(f"[acco-bench] calibration: ddp at {rate_label(bandwidth)}: compute {res['compute_s']:.3f} s, comm "
        f"{res['comm_s']:.3f} s per update (share {res['share']:.2f}), {res['bytes_per_update'] / 2**20:.2f} "
        "MiB sent per host per update")
    return res


def calibrate(settings, net, share: float, out: Path, log=print, unshaped: dict | None = None) -> dict:
    """Find the rate at which ddp's comm is ``share`` of its step and set ``net``'s links to it.
    ``unshaped``: the unshaped probe of an earlier calibration on the same network (a sweep)."""
    check_share(share)
    if getattr(net, "cluster", None) is None:
        raise BenchError("--comm-share needs emulated hosts (root and iproute2): on loopback there is "
                         "no link to set; use --bandwidth or leave --loopback out")
    base = unshaped or probe(settings, net, None, out, log)
    c0, m0, bits0 = base["compute_s"], base["comm_s"], 8 * base["bytes_per_update"]
    first = tc_rate(rate_for_share(c0, share, bits0, m0))
    shaped = probe(settings, net, first, out, log)
    bits = fitted_bits(m0, parse_rate(first), shaped["comm_s"], bits0)
    compute = (c0 + shaped["compute_s"]) / 2
    rate = tc_rate(rate_for_share(compute, share, bits, m0))
    probes = [shaped]
    if probes_disagree(c0, shaped["compute_s"]):
        log(f"[acco-bench] calibration: ddp's compute moved from {c0:.3f} s to {shaped['compute_s']:.3f} s "
            "per update between the probes (the machine's speed): a third probe decides")
        probes.append(probe(settings, net, rate, out, log, name="third"))
        compute = statistics.median([c0, shaped["compute_s"], probes[-1]["compute_s"]])
        rate = tc_rate(rate_for_share(compute, share, bits, m0))
    net.set_bandwidth(rate)
    log(f"[acco-bench] calibration: comm share {share:.2f} -> rate {rate_label(rate)} ({rate})")
    return {"comm_share_asked": share, "rate": rate, "compute_s": compute, "fixed_comm_s": m0,
            "bits_per_update_counted": bits0,
            "bits_per_update_fitted": bits, "unshaped": base, "probes": probes}


def probes_disagree(c0: float, c1: float) -> bool:
    """Two probes' compute per update further apart than :data:`PROBE_SPREAD`."""
    return max(c0, c1) > (1 + PROBE_SPREAD) * min(c0, c1)
