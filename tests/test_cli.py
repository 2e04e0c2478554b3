"""The start-up path of acco/cli.py: one function decides the process's role, the job is validated
once (by the launcher, or by rank 0), a launched worker is handed the validated job instead of
composing the config again, and the trainer receives prepared rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from distributed import clean_env, write_script
from validation_helpers import NO_WORKER_LAUNCHER

from acco import cli
from acco.config import EXIT_SAVED_ON_SIGNAL, compose
from acco.data.loader import Rows
from acco.launch.local import GO_FD_ENV

TINY = ["train.nb_steps_tot=16", "train.eval=false", "train.save=false", "data.n_docs=300"]


def job_overrides(tmp_path, *more: str) -> list[str]:
    return [f"train.output_dir={tmp_path / 'out'}", f"train.cache_dir={tmp_path / 'cache'}", *TINY, *more]


@pytest.mark.parametrize(
    ("env", "nproc", "role", "world_size"),
    [
        ({}, 1, cli.Role.WORKER, 1),  # a plain python main.py with one worker: it is that worker
        ({}, 3, cli.Role.LAUNCHER, 3),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
            1,
            cli.Role.WORKER,
            4,
        ),  # torchrun: launch.nproc unread
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", GO_FD_ENV: "9"}, 1, cli.Role.LAUNCHED, 2),
    ],
)
def test_one_function_decides_the_role(monkeypatch, env, nproc, role, world_size):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", GO_FD_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = compose([f"launch.nproc={nproc}"])
    assert cli.process_role(cfg) == (role, world_size)
    if role is cli.Role.LAUNCHED:  # it composes nothing: the launcher hands it the job
        assert cli.process_role(None) == (role, world_size)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_srun_an_error_names_its_rank_and_a_warning_comes_once(monkeypatch, capsys, rank):
    """srun sets SLURM_PROCID, not RANK: a worker's error line still names it, and acco's config
    warnings come from rank 0 alone, not once per task (as under torchrun and the local launcher)."""
    from acco.engine.config import ConfigWarning

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_PROCID": rank, "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(name, value)
    cli._report(RuntimeError("ring exchange failed"))
    cli._one_line_warnings(None)("train.warmup=48 is not below ...", ConfigWarning, "f.py", 1)
    err = capsys.readouterr().err
    warned = "acco: warning: train.warmup=48 is not below ...\n" if rank == "0" else ""
    assert err == f"acco: error: [rank {rank}] RuntimeError: ring exchange failed\n{warned}"


def test_a_lone_worker_validates_once_and_hands_the_trainer_rows(tmp_path, monkeypatch):
    """launch.nproc=1, in-process: one validation pass, whose corpus and tokenizer the worker takes
    (nothing of it kept while training), and the trainer is handed ready rows, not documents."""
    import acco.data.prepare as prepare
    import acco.trainer
    import acco.validate

    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # run() sets them
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    checks, handed, seen = [], [], {}
    check_job = acco.validate.check_job
    monkeypatch.setattr(acco.validate, "check_job", lambda job: checks.append(job) or check_job(job))
    prepare_data = prepare.prepare_data

    def recording_prepare_data(job):
        handed.append(job.loaded)
        data = prepare_data(job)
        seen["loaded after"] = job.loaded
        return data

    monkeypatch.setattr(prepare, "prepare_data", recording_prepare_data)
    init = acco.trainer.DecoupledTrainer.__init__

    def recording_init(self, *args, **kwargs):
        seen["train"], seen["eval"] = kwargs["train_dataset"], kwargs["eval_dataset"]
        init(self, *args, **kwargs)

    monkeypatch.setattr(acco.trainer.DecoupledTrainer, "__init__", recording_init)
    import acco.host_memory

    keep = acco.host_memory.keep_heap_small
    monkeypatch.setattr(acco.host_memory, "keep_heap_small", lambda: seen.setdefault("heap", keep()))
    calls = _count_calls(monkeypatch)
    assert cli.run(compose(["launch.nproc=1", *job_overrides(tmp_path, "train.eval=true")])) == 0
    # each done once in the process: the trainer is handed what the command line did
    assert calls == {"init_distributed": 1, "manual_seed": 1, "check_output_dir": 1}
    assert seen["heap"] is True  # the worker fixed glibc's mmap threshold before building anything
    assert len(checks) == 1  # the one validation pass
    assert handed[0] is not None and handed[0].corpus is not None  # its corpus, taken by the worker
    assert seen["loaded after"] is None  # and let go of once the rows exist
    assert isinstance(seen["train"], Rows) and isinstance(seen["eval"], Rows)
    assert (tmp_path / "out" / "summary.json").exists()


def _count_calls(monkeypatch) -> dict[str, int]:
    """Counts, in `calls`, the process group joined, torch's seed set and the run folder checked,
    under every name the command line and the trainer reach them by."""
    import torch

    import acco.launch.process_group
    import acco.trainer
    import acco.validate

    calls = {}

    def counted(module, name):
        real = getattr(module, name)
        calls[name] = 0

        def count(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return count

    init = counted(acco.launch.process_group, "init_distributed")
    for module in (acco.launch.process_group, acco.trainer):
        monkeypatch.setattr(module, "init_distributed", init)
    monkeypatch.setattr(torch, "manual_seed", counted(torch, "manual_seed"))
    monkeypatch.setattr(acco.validate, "check_output_dir", counted(acco.validate, "check_output_dir"))
    return calls


# A worker command that fails if it validates or composes: the launcher must hand it the job.
WORKER = """
    import sys
    import acco.cli, acco.config, acco.validate

    def refuse(what):
        def refused(*args, **kwargs):
            raise AssertionError(f"a launched worker called {what}")
        return refused

    acco.validate.check_job = refuse("check_job")
    acco.config.compose = acco.cli.compose = refuse("compose")
    acco.cli.main()
"""

LAUNCHER = """
    import atexit, sys
    import acco.cli, acco.validate

    calls = []
    check_job = acco.validate.check_job
    acco.validate.check_job = lambda job: calls.append(job.world_size) or check_job(job)
    worker, overrides = sys.argv[1], sys.argv[2:]
    acco.cli.self_command = lambda: [sys.executable, worker, *overrides]
    atexit.register(lambda: print(f"launcher validated {calls}", flush=True))
    sys.argv[1:] = overrides  # the launcher is acco's own command line
    acco.cli.main()
"""


@pytest.mark.slow
def test_the_launcher_validates_and_hands_its_workers_the_job(tmp_path):
    worker = write_script(tmp_path, "worker.py", WORKER)
    launcher = write_script(tmp_path, "launcher.py", LAUNCHER)
    seed_key = "train.dataloader_num_workers=4"  # a seed key acco ignores: said once, in one line
    warmup = "train.warmup=16"  # the whole budget (16): legal, said once, in one line
    cmd = [sys.executable, launcher, worker, "launch.nproc=2", *job_overrides(tmp_path, seed_key, warmup)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    warned = "acco: warning: ignoring the seed's train key(s) dataloader_num_workers: they have no effect"
    assert proc.stderr.count(warned) == 1 and "UserWarning" not in proc.stderr, proc.stderr
    assert proc.stderr.count("acco: warning: train.warmup=16 is not below train.nb_steps_tot=16") == 1
    assert "launcher validated [2]" in proc.stdout  # once, for two workers
    assert "done: acco " in proc.stdout  # the workers trained
    # what is trained, said once: the model's size and the vocabulary of the BPE trained for it
    out = proc.stdout
    assert re.search(r"^BPE tokenizer trained on the data \(\d+ tokens of the 2048 asked\)", out, re.M), out
    model = re.findall(r"^model: tiny, ([\d,]+) parameters, vocabulary ([\d,]+); attention: ", out, re.M)
    assert len(model) == 1 and int(model[0][0].replace(",", "")) > 1000, proc.stdout
    # what became of the token cache is said once: rank 1, which maps the file rank 0 wrote or
    # found, says nothing of it
    cache_lines = [line for line in proc.stdout.splitlines() if line.startswith("token stream")]
    assert len(cache_lines) == 1, proc.stdout
    saved = (tmp_path / "out" / "config.yaml").read_text()
    assert "nb_steps_tot: 16" in saved and "${" not in saved  # the job as composed, resolved




@pytest.mark.parametrize("folder", ["finished run", "output_dir a file"])
def test_the_launcher_refuses_a_folder_before_it_starts_a_worker_or_imports_torch(tmp_path, folder):
    """An output_dir that holds a finished run (or that is a file) is said at once: no worker
    started, torch not imported (it was seconds of a 2-core VM's time, and the workers' imports)."""
    out = tmp_path / "out"
    if folder == "finished run":
        out.mkdir()
        (out / "summary.json").write_text("{}")
    else:
        out.write_text("mine")
    script = write_script(tmp_path, "launcher.py", NO_WORKER_LAUNCHER)
    cmd = [sys.executable, script, "launch.nproc=2", *job_overrides(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("acco: error:")]
    want = "already holds a run (summary.json)" if folder == "finished run" else "is a file, not a folder"
    assert proc.returncode == 1 and len(lines) == 1 and want in lines[0], proc.stderr[-2000:]
    assert "torch imported: False" in proc.stdout, proc.stdout


def test_help_names_acco_its_choices_and_where_every_key_is_documented():
    """`python main.py --help`: acco's own header, the groups to pick from, and pointers to the docs
    that exist (Hydra's default said "cli is powered by Hydra")."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "main.py"), "--help"], capture_output=True, text=True,
                         env=clean_env(), cwd=root, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("acco: train a causal LM") and "powered by Hydra" not in text
    assert "train: acco, acco-ft" in text and "nb_steps_tot:" in text
    docs = re.findall(r"docs/\w+\.md", text)
    assert docs and all((root / d).is_file() for d in docs), docs


def test_a_group_s_key_at_the_top_level_or_as_a_flag_names_the_override_meant():
    """`nproc=4` and `--nproc 4` (torchrun's and argparse's habits) get the key=value acco takes, in
    one line: not only the top-level keys, nor Hydra's usage block."""
    from pathlib import Path

    from acco.config import InputError

    with pytest.raises(InputError, match=r"^unknown config key 'nproc' in 'nproc=4' \(did you mean "
                                         r"'launch\.nproc'\?\); keys at the top level: "):
        compose(["nproc=4"])
    # a transformers.Trainer user's names: acco's key, where its unit is said
    with pytest.raises(InputError, match=r"^unknown config key 'train\.per_device_train_batch_size' in .* "
                                         r"\(transformers' name: acco's key is 'train\.batch_size'; docs/"):
        compose(["train.per_device_train_batch_size=4"])
    from acco.config import ConfigError, TrainArgs

    said = r"^unknown train key 'max_steps' \(transformers' name: acco's key is 'nb_steps_tot'; docs/training"
    with pytest.raises(ConfigError, match=said + r"\.md, 'Glossary', gives its unit\)"):
        TrainArgs.from_any({"max_steps": 100})  # DecoupledTrainer(args=...)
    main = Path(__file__).resolve().parents[1] / "main.py"
    cases = ((["--nproc", "4"], " (did you mean 'launch.nproc=4'?)"),
             (["--learning-rate=1e-3"], " (did you mean 'train.learning_rate=1e-3'?)"), (["--nothing"], ""))
    for args, meant in cases:
        out = subprocess.run([sys.executable, str(main), *args], capture_output=True, text=True,
                             env=clean_env(), timeout=120)  # fmt: skip
        flag = args[0].split("=")[0]
        assert (out.returncode, out.stdout) == (2, ""), out
        assert out.stderr == (f"acco: error: unknown option '{flag}'{meant}: settings are key=value "
                              "overrides, e.g. launch.nproc=2 train=acco\n"), out.stderr


EXIT = """
    import atexit, sys, threading
    import acco.cli

    class SaidAtTeardown:  # a module global's __del__ runs only when Python finalizes its modules
        def __del__(self):
            sys.stdout.write("finalized\\n")

    kept = SaidAtTeardown()

    def main():
        print("buffered", end="")  # to a pipe: block-buffered, unflushed when main returns
        atexit.register(lambda: print(" atexit", end=""))
        threading.Timer(0.2, lambda: print(" thread", end="")).start()  # still running when main ends
        raise SystemExit(int(sys.argv[1]))

    acco.cli.main = main
    acco.cli.entry()
"""


@pytest.mark.parametrize("code", [0, EXIT_SAVED_ON_SIGNAL])
def test_the_entry_exits_with_main_s_code_after_threads_and_atexit_hooks_without_finalizing(tmp_path, code):
    """acco-train's entry after a run that ended its own way: what a normal exit does that outputs
    depend on (the other threads joined, the atexit hooks run, stdout flushed), but not the
    seconds of tearing torch's modules down."""
    script = write_script(tmp_path, "exit.py", EXIT)
    proc = subprocess.run([sys.executable, script, str(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "buffered thread atexit", proc.stdout


POOLS = """
    import sys, threading
    from concurrent.futures import ThreadPoolExecutor
    import acco.cli

    # Library pools, kept as inductor keeps its compile pool: their threads are no daemons, and
    # concurrent.futures stops them from its own exit hook only (threading._register_atexit)
    pools = []

    def main():
        idle, busy = ThreadPoolExecutor(2), ThreadPoolExecutor(1)
        pools.extend((idle, busy))  # a pool let go of would stop its threads itself
        idle.submit(print, "pool", end="").result()  # its worker now waits for more
        busy.submit(threading.Event().wait, 0.2)  # still at work when main ends
        busy.submit(print, " queued", end="")  # and work queued behind it: a normal exit runs it
        alive = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
        print(f" {len(alive)} threads", end="")
        raise SystemExit(int(sys.argv[1]))

    acco.cli.main = main
    acco.cli.entry()
"""


@pytest.mark.parametrize("code", [0, EXIT_SAVED_ON_SIGNAL])
def test_the_entry_exits_with_library_thread_pools_alive(tmp_path, code):
    """A compiled run's workers trained, said done, and then waited forever on inductor's idle
    compile pool: the entry's exit stops library pools as Python's exit does, the work they were
    given done first. The timeout fails a hang, it never hangs the suite."""
    script = write_script(tmp_path, "pools.py", POOLS)
    proc = subprocess.run([sys.executable, script, str(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "pool 2 threads queued", proc.stdout


HELD_WRITE = """
    import threading
    import acco.checkpoint, acco.cli

    exiting = threading.Event()
    save, leave = acco.checkpoint.save, acco.cli.exit_without_finalizing

    def held_save(*args, **kwargs):
        # The run's one checkpoint, written in the background, holds itself until the exit has
        # started (or 2 s): an exit that left without it would leave while it is held.
        exiting.wait(2.0)
        folder = save(*args, **kwargs)
        print("written", folder.name, flush=True)
        return folder

    def exit_without_finalizing(code):
        exiting.set()
        print("exit", flush=True)
        leave(code)

    acco.checkpoint.save = held_save
    acco.cli.exit_without_finalizing = exit_without_finalizing
    acco.cli.entry()
"""


def test_the_last_background_checkpoint_lands_before_the_process_exits(tmp_path):
    """A one-worker job through the entry, its final checkpoint written in the background
    (train.async_save, the default) and held: the exit starts only once it is on disk, whole."""
    from acco import resume, run_folder

    script = write_script(tmp_path, "held.py", HELD_WRITE)
    out = tmp_path / "out"
    overrides = job_overrides(tmp_path, "launch.nproc=1", "train.nb_steps_tot=8", "train.save=true")
    cmd = [sys.executable, script, *overrides]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith(("written", "exit"))]
    saved = run_folder.checkpoint_folders(out)
    assert len(saved) == 1, (said, proc.stdout[-2000:])
    newest = saved[0]
    assert said == [f"written {newest.name}", "exit"], proc.stdout
    meta = resume.verify(newest)  # every shard whole: the sizes written and the CRCs
    assert meta["samples"] == 8 and not list(out.glob("*.tmp")), meta


# A worker that says which of its threads are alive and no daemons as its exit starts; inductor's
# cache its own and empty (a warm one compiles nothing, and starts no pool).
THREADS_AT_EXIT = """
    import os, threading
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["INDUCTOR_CACHES"], os.environ["RANK"])
    import acco.cli

    leave = acco.cli.exit_without_finalizing

    def exit_without_finalizing(code):
        main = threading.main_thread()
        alive = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not main)
        print("threads at exit:", alive, flush=True)
        leave(code)

    acco.cli.exit_without_finalizing = exit_without_finalizing
    acco.cli.entry()
"""

# The launcher of main.py, its workers started as `worker` instead.
LAUNCH_AS = """
    import sys
    import acco.cli

    worker, overrides = sys.argv[1], sys.argv[2:]
    acco.cli.self_command = lambda: [sys.executable, worker, *overrides]
    sys.argv[1:] = overrides
    acco.cli.entry()
"""


@pytest.mark.slow
def test_a_compiled_run_exits(tmp_path):
    """train.compile=true (inductor) on 2 workers: both trained, said done and then waited forever
    on inductor's compile pool (py-spy: Thread.join in the exit, idle ThreadPoolExecutor threads).
    Both workers exit with the pool alive; the timeout fails a hang."""
    worker = write_script(tmp_path, "worker.py", THREADS_AT_EXIT)
    launcher = write_script(tmp_path, "launcher.py", LAUNCH_AS)
    cmd = [sys.executable, launcher, worker, "launch.nproc=2", "train.compile=true",
           *job_overrides(tmp_path, "train.nb_steps_tot=8")]  # fmt: skip  (the last value counts)
    # the pool, whatever the cores: inductor starts none where it would compile with one thread
    env = clean_env({"INDUCTOR_CACHES": str(tmp_path / "inductor"), "TORCHINDUCTOR_COMPILE_THREADS": "2"})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "done: acco 8 micro-batches" in proc.stdout, proc.stdout[-2000:]
    at_exit = [line for line in proc.stdout.splitlines() if line.startswith("threads at exit:")]
    assert len(at_exit) == 2 and all("ThreadPoolExecutor" in line for line in at_exit), at_exit


def test_after_a_failure_the_entry_exits_as_python_does(tmp_path):
    """A failed rank 0 keeps the rendezvous store it hosts up while it finalizes: its peers then
    say their own error rather than lose the store mid-read."""
    script = write_script(tmp_path, "exit.py", EXIT)
    proc = subprocess.run([sys.executable, script, "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "buffered thread atexitfinalized\n", proc.stdout


def test_main_s_exits_with_a_message_are_python_s_to_say(tmp_path):
    script = write_script(tmp_path, "exit.py", EXIT.replace("int(sys.argv[1])", "'acco: a message'"))
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == "acco: a message", proc.stderr
