"""``acco-bench gpu --profile VARIANT``: is the GPU the bound, and where does its time go.

A few updates run after the variant's timed ones (its tokens/s is untouched) under torch.profiler,
which records only the device's work (kernels, copies, memsets through CUPTI: no CPU ops, so the
profiler adds little host time of its own). From those records, per micro-batch:

- ``busy``: the union of the device's intervals on every stream (the comm stream's included) over
  the window's wall time. Near 1 the GPU is the bound, and ``top`` says where its time goes; well
  below 1 it waits on the host (Python, kernel launches) or on a sync, and faster kernels would buy
  nothing;
- ``top``: the kernels that took the most device time;
- ``host``: the CPU time of the training thread (and of the whole process: the comm thread, the
  profiler) over the window's wall time. With ``busy`` well below 1, a training thread near 1
  computes or launches all the time (the host is the bound: CUDA graphs, fewer compiled calls),
  one well below 1 waits (a sync, or the host blocked on something).

On the CPU there is no device work to record (``--device cpu`` checks the code path): ``busy`` is
None. `summarise` is the arithmetic, tested on made-up intervals (tests/test_gpu_profile.py).
"""

from __future__ import annotations

import time

UPDATES = 2  # profiled updates, after the timed ones
TOP = 12  # kernels listed


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarise(kernels: list[tuple[str, float, float]], wall_s: float, micro_batches: int,
              thread_cpu_s: float | None = None, process_cpu_s: float | None = None) -> dict:
    """`kernels` as (name, start us, end us) over a window of `wall_s` seconds and `micro_batches`;
    the training thread's and the process's CPU seconds over it, where measured."""
    by_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        by_name.setdefault(name, []).append(end - start)
    busy = busy_us([(start, end) for _, start, end in kernels])
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP]
    return {
        "micro_batches": micro_batches,
        "wall_ms_per_micro_batch": 1000 * wall_s / micro_batches,
        "device_busy_ms_per_micro_batch": busy / 1000 / micro_batches,
        "busy": busy / 1e6 / wall_s if kernels else None,
        "kernels_per_micro_batch": len(kernels) / micro_batches,
        "host": None if thread_cpu_s is None else thread_cpu_s / wall_s,
        "process_cpu": None if process_cpu_s is None else process_cpu_s / wall_s,
        "top": [
            {"kernel": name[:120], "ms_per_micro_batch": sum(d) / 1000 / micro_batches, "calls": len(d)}
            for name, d in top
        ],
    }


class Window:
    """start() before the profiled updates, stop(micro_batches) after them; each syncs the device.
    A profiler that fails (no CUPTI on the machine) costs the variant nothing: stop() then returns
    the error, and the variant's figures stand."""

    def __init__(self, device):
        self.device = device
        self._prof, self._error, self._t0 = None, None, None
        self._cpu0 = (0.0, 0.0)  # the training thread's and the process's CPU seconds at start()

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._sync()
        cuda = self.device.type == "cuda"
        try:
            self._prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            self._prof.start()
        except Exception as e:  # noqa: BLE001
            self._prof, self._error = None, repr(e)
        self._cpu0 = (time.thread_time(), time.process_time())
        self._t0 = time.perf_counter()

    def stop(self, micro_batches: int) -> dict:
        from torch.autograd import DeviceType

        if self._t0 is None:  # the run ended before its profiled updates (fewer records than asked)
            return {"micro_batches": micro_batches, "error": "the run ended before the profiled updates"}
        self._sync()
        wall = time.perf_counter() - self._t0
        cpu = (time.thread_time() - self._cpu0[0], time.process_time() - self._cpu0[1])
        try:
            if self._prof is None:
                raise RuntimeError(self._error)
            self._prof.stop()
            kernels = [
                (e.name, e.time_range.start, e.time_range.end)
                for e in self._prof.events()
                if e.device_type == DeviceType.CUDA
            ]
        except Exception as e:  # noqa: BLE001
            return {"micro_batches": micro_batches, "error": self._error or repr(e)}
        return summarise(kernels, wall, micro_batches, *cpu)


def markdown(p: dict) -> list[str]:
    from acco_bench.report import fmt, md_table

    if "error" in p:
        return ["", f"Profile of {p['variant']}: the profiler failed: {p['error']}"]
    busy = "no device work recorded" if p["busy"] is None else f"busy {100 * p['busy']:.0f}% of the time"
    lines = [
        "",
        f"Profile of {p['variant']} ({p['micro_batches']} micro-batches after its timed updates): "
        f"{p['wall_ms_per_micro_batch']:.2f} ms per micro-batch, the device {busy} "
        f"({p['device_busy_ms_per_micro_batch']:.2f} ms), {p['kernels_per_micro_batch']:.0f} kernels "
        "per micro-batch" + _host(p) + ".",
    ]
    if p["top"]:
        rows = [[k["kernel"], fmt(k["ms_per_micro_batch"], 3), k["calls"]] for k in p["top"]]
        lines += ["", md_table(["kernel", "ms per micro-batch", "calls"], rows)]
    return lines


def _host(p: dict) -> str:
    if p.get("host") is None:
        return ""
    return (f"; the training thread on the CPU {100 * p['host']:.0f}% of the time, the process "
            f"{100 * p['process_cpu']:.0f}% (of one core)")
