"""Each default stated once: the collective timeout (TrainArgs'), the launch group's (LaunchConfig's,
not restated in config.yaml), the tiny recipe (no library default restated that base.yaml does
not change) and GPT-Neo's window (acco.config.GPT_NEO_WINDOW, which acco.models' model carries)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from acco.config import GPT_NEO_WINDOW, LaunchConfig, TrainArgs, compose

CONF = Path(__file__).resolve().parents[1] / "acco" / "conf"


def test_the_collective_timeout_has_one_default():
    cfg = compose([])
    assert cfg.launch.timeout_s == cfg.train.timeout_s == LaunchConfig().timeout_s == TrainArgs().timeout_s
    assert compose(["launch.timeout_s=7"]).train.timeout_s == 7  # launch.timeout_s sets both


def test_config_yaml_restates_no_launch_default():
    assert "launch" not in yaml.safe_load((CONF / "config.yaml").read_text())
    assert dict(compose([]).launch) == dataclasses.asdict(LaunchConfig())


def test_the_tiny_recipe_sets_a_library_default_only_to_undo_base_yaml():
    defaults = {f.name: f.default for f in dataclasses.fields(TrainArgs)}
    base = yaml.safe_load((CONF / "train" / "base.yaml").read_text())
    recipe = yaml.safe_load((CONF / "recipe" / "tiny.yaml").read_text())["train"]
    restated = [k for k, v in recipe.items() if defaults.get(k) == v and k not in base]
    assert restated == []


def test_gpt_neo_window_default_is_the_models():
    from acco.models import model_config

    tiny = {
        k: v
        for k, v in yaml.safe_load((CONF / "model" / "tiny.yaml").read_text()).items()
        if k != "tokenizer"
    }
    assert model_config({**tiny, "window_size": None}, 300).window_size == GPT_NEO_WINDOW
