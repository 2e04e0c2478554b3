"""tools/gpu_check.sh, the GPU checks in one time-boxed run, is run here with a recorder in place of
python: every command it would run on a lent GPU parses (acco-bench's arguments and variant names,
the model configs, the test files, main.py's overrides), in the order that puts the headline
figures first, and a step the budget cannot hold is skipped with a line instead of cut short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from acco.config import compose
from acco_bench.cli import build_parser
from acco_bench.gpu import parse_variants
from acco_bench.settings import model_settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if "--out" in sys.argv:  # what acco-bench gpu writes
    out = sys.argv[sys.argv.index("--out") + 1]
    os.makedirs(out, exist_ok=True)
    for name in ("gpu.json", "gpu.md"):
        open(os.path.join(out, name), "w").close()
"""


def _run(tmp_path: Path, budget: int) -> tuple[str, list[list[str]]]:
    recorder = tmp_path / "python"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: none (a test)'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    record = tmp_path / "record.jsonl"
    env = dict(os.environ, PY=str(recorder), RECORD=str(record), OUT=str(tmp_path / "out"),
               BUDGET=str(budget), PATH=f"{tmp_path}:{os.environ['PATH']}")  # fmt: skip
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, [json.loads(line) for line in record.read_text().splitlines()]


def test_every_command_parses_headline_first(tmp_path):
    out, calls = _run(tmp_path, budget=10_000)
    steps = [line.split()[1] for line in out.splitlines() if line.startswith("== ") and " rc=0 " in line]
    assert steps == ["gpu8", "gpu8cg", "gpu8whole", "graphs", "onegpu", "gpu24", "e2e-diloco",
                     "e2e-streaming-diloco", "llama3"]
    bench, tests, trainings = [], [], []
    for argv in calls:
        if argv[:2] == ["-m", "acco_bench"]:
            args = build_parser().parse_args(argv[2:])
            assert args.command == "gpu"
            parse_variants(args.variants)  # raises on an unknown variant
            model_settings(args.model)  # raises on an unknown model config
            bench.append(args)
        elif argv[:2] == ["-m", "pytest"]:
            files = [a for a in argv if a.startswith("tests/")]
            assert files and all((ROOT / f).is_file() for f in files), argv
            tests += files
        elif argv and argv[0].endswith("main.py"):
            assert Path(argv[0]) == ROOT / "main.py"
            compose(argv[1:])  # raises on an unknown key or a bad value
            trainings.append(argv[1])
        elif argv[:3] != ["-m", "pip", "install"]:  # the wheels, where prepare.sh made .gpu/whl
            assert argv[0] == "-c", argv  # the version line
    assert [(a.model, a.batch_size) for a in bench] == [
        ("gptneo-125m", 8),
        ("gptneo-125m", 8),
        ("gptneo-125m", 8),
        ("gptneo-125m", 24),
        ("llama3", 4),
    ]
    first = bench[0]  # the headline, in one run: compiled and eager, engine and plain loop
    assert set(parse_variants(first.variants)) >= {
        ("engine-acco-compiled", "engine-acco", False, True, "blocked"),
        ("plain-bf16-compiled", "plain-bf16", False, True, "blocked"),
        ("engine-acco", "engine-acco", False, False, "blocked"),
        ("nanogpt-compiled", "nanogpt", False, True, "blocked"),  # the anchor, on the same machine
    }
    assert first.micro == "on" and not first.no_stream_check
    # is the GPU the bound at 8 x 1024, and what does the engine add to the plain loop's kernels
    assert first.profile == "engine-acco-compiled,plain-bf16-compiled,nanogpt-compiled"
    assert set(first.profile.split(",")) <= {name for name, *_ in parse_variants(first.variants)}
    graphs = bench[1]  # CUDA graphs, profiled: what they buy at the size the host may bound
    assert graphs.compile_mode == "reduce-overhead"
    assert graphs.profile == "engine-acco-compiled,plain-bf16-compiled"
    whole = bench[2]  # the body compiled as one graph, profiled: fewer compiled calls per micro-batch
    assert whole.compile_scope == "model" and whole.compile_mode is None
    assert whole.profile == "engine-acco-compiled,plain-bf16-compiled"
    paper = bench[3]  # 24 x 1024, and last the blocked local layers against the full mask in-model
    assert [(b, compiled, local) for _, b, _, compiled, local in parse_variants(paper.variants)][-1:] == [
        ("engine-acco", True, "mask")]
    assert tests == ["tests/test_cuda_graphs.py", "tests/test_cuda_one_gpu.py"]
    assert trainings == ["train=diloco", "train=streaming-diloco"]
    # a lent machine gives back 8 files at most: the logs are one file, and only the first step
    # keeps its gpu.json beside the gpu.md every acco-bench step writes
    files = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert files == ["check.log", "gpu-llama/gpu.md", "gpu24/gpu.md", "gpu8/gpu.json", "gpu8/gpu.md",
                     "gpu8cg/gpu.md", "gpu8whole/gpu.md"], files
    assert [line.split()[1] for line in (tmp_path / "out" / "check.log").read_text().splitlines()
            if line.startswith("== ")] == steps


def test_a_step_the_budget_cannot_hold_is_skipped(tmp_path):
    out, calls = _run(tmp_path, budget=105)
    assert "== gpu8 skipped: 240s asked" in out and "== onegpu skipped: 170s asked" in out
    assert "== graphs skipped: 120s asked" in out
    assert "== gpu24 rc=0" in out and "== e2e-diloco rc=0" in out  # 100 s and 90 s still fit
    assert "== llama3 skipped: 120s asked" in out
    assert "== gpu8cg rc=0" in out and "== gpu8whole rc=0" in out  # 100 s fits
    assert [a[2:4] for a in calls if a[:2] == ["-m", "acco_bench"]] == [
        ["gpu", "--compile-mode"], ["gpu", "--compile-scope"], ["gpu", "--batch-size"]
    ]
