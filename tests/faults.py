"""acco's CLI with a fault injected into one worker, for the tests of failure handling:

    python tests/faults.py rank=1,step=6,mode=exit launch.nproc=2 train.output_dir=...
    torchrun --nproc-per-node 2 --max-restarts 1 tests/faults.py rank=1,step=6,mode=exit,attempt=0 ...

The local launcher starts every worker with this same command line, so each worker installs the
fault before training; only the named rank acts on it. Modes, after update `step` (once its
evaluation and checkpoint are done): `exit` dies as a killed process would, `hang` stalls forever
holding its sockets open; `nan`: every micro-batch loss after the first `step` is NaN.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def install(spec: str) -> None:
    fields = dict(item.split("=", 1) for item in spec.split(","))
    rank, step, mode = int(fields["rank"]), int(fields["step"]), fields["mode"]
    if os.environ.get("RANK") != str(rank):  # the launcher itself, or another worker
        return
    # attempt=N: only in torchrun's N-th start of the workers (0: the first, before any restart)
    if "attempt" in fields and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != fields["attempt"]:
        return
    from acco.engine.decoupled import DecoupledEngine

    run = DecoupledEngine.run  # the methods but torch-ddp, whose engine has its own run

    def run_with_fault(self, batches, loss_fn):
        calls = [0]

        def poisoned(model, batch):
            loss, weight = loss_fn(model, batch)
            calls[0] += 1
            return (loss * float("nan") if calls[0] > step else loss), weight

        for record in run(self, batches, poisoned if mode == "nan" else loss_fn):
            yield record  # the trainer logs, evaluates and saves this update before the next
            if record.step == step and mode == "exit":  # one write: the time the run's end is measured from
                line = f"acco: test fault: rank {rank} exits after update {step} at {time.monotonic()!r}\n"
                os.write(2, line.encode())
                os._exit(17)  # no clean-up
            if record.step == step and mode == "hang":  # tests time the detection from this line
                print(f"acco: test fault: rank {rank} hangs after update {step}", file=sys.stderr, flush=True)
                threading.Event().wait()

    DecoupledEngine.run = run_with_fault


if __name__ == "__main__":
    install(sys.argv.pop(1))
    from acco.cli import entry

    entry()
