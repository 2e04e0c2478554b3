"""The benchmarks fall back to the library's defaults, and acco-bench's flags to BenchSettings':
each default is stated once (acco/engine/config.py's EngineSettings, acco_bench/settings.py)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

import acco
from acco.config import compose
from acco.engine.config import EngineConfig, EngineSettings
from acco.job import job_of
from acco_bench import reference, reference_lm
from acco_bench.cli import _settings, build_parser
from acco_bench.lr_sweep import estimate_of
from acco_bench.settings import KNOWN_METHODS, VARIANTS, BenchSettings, base_method

LIBRARY = EngineSettings()


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineSettings)])
def test_the_reference_falls_back_to_the_librarys_default(name):
    """A settings mapping that leaves a key out trains as the library would (weight decay 0.1, ...)."""
    assert reference._get({}, name) == getattr(LIBRARY, name)
    assert reference._get(EngineConfig(), name) == getattr(LIBRARY, name)


def test_the_references_adamw_decays_as_the_library():
    import torch

    model = torch.nn.Linear(3, 2)
    opt = reference._adamw(list(model.parameters()), {"learning_rate": 1e-3})
    assert [g["weight_decay"] for g in opt.param_groups] == [LIBRARY.weight_decay, 0.0]  # matrices, biases
    assert opt.defaults["betas"] == (LIBRARY.adam_beta1, LIBRARY.adam_beta2)
    assert opt.defaults["eps"] == LIBRARY.adam_eps


def test_the_reference_check_uses_the_runs_estimate():
    """acco runs the train config's estimate (the library's unless overridden); its variants their own."""
    train = {"acco_estimate": LIBRARY.acco_estimate}
    assert estimate_of("acco", train) == LIBRARY.acco_estimate == "lean"
    assert estimate_of("acco-int8", train) == LIBRARY.acco_estimate
    assert estimate_of("acco-paper", train) == "paper"
    assert estimate_of("acco-lean", {"acco_estimate": "paper"}) == "lean"
    # simulate takes clipping and the estimate from the case's train config, not defaults of its own
    own = set(inspect.signature(reference_lm.simulate).parameters)
    assert not {"estimate", "max_grad_norm", "weight_decay"} & own


@pytest.mark.parametrize("command", ["cluster", "sweep", "convergence", "lr-sweep", "race"])
def test_the_flags_default_to_the_bench_settings(command):
    """A flag left out gives BenchSettings' default, except what a subcommand sets for itself
    (its budget and methods, and the settings named here)."""
    args = build_parser().parse_args([command])
    own = {"nb_steps_tot", "methods"} | {
        "convergence": {"data", "data_path", "model_size", "max_length", "loopback", "eval_step", "bandwidth",
                        "latency"},
        "lr-sweep": {"loopback", "eval_step", "bandwidth", "latency"},
        "race": {"accumulate_while_waiting", "retry_disturbed", "eval_step"},
    }.get(command, set())
    kw = {"bandwidth": getattr(args, "bandwidth", None), "latency": getattr(args, "latency", None),
          "comm_share": getattr(args, "comm_share", None)}
    if command == "sweep":
        kw.pop("bandwidth")
    got = dataclasses.asdict(_settings(args, **kw))
    want = dataclasses.asdict(BenchSettings())
    assert {k: got[k] for k in want if k not in own} == {k: want[k] for k in want if k not in own}


@pytest.mark.parametrize("method", KNOWN_METHODS)
def test_every_method_and_variant_makes_a_valid_job(method, tmp_path):
    """What acco-bench passes a worker composes and validates, and each variant's overrides land."""
    if not (Path(acco.__file__).parent / "conf" / "train" / f"{base_method(method)}.yaml").exists():
        pytest.skip(f"train/{base_method(method)}.yaml is not in this checkout yet")
    if method.endswith("-sharded"):  # sharded inside the node: raced only on nodes (NAME-nodes)
        method += "-nodes"
    job = job_of(compose(BenchSettings().overrides(method, tmp_path, rank=0)), world_size=2)
    assert job.args.method_name == base_method(method)
    method = method.removesuffix("-nodes")
    for override in VARIANTS.get(method, (None, ()))[1]:
        key, value = override.split("=", 1)
        assert getattr(job.args, key.removeprefix("train.")) == yaml.safe_load(value), override
