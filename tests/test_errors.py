"""Bad input: one line `acco: error: ...` naming the problem, a non-zero exit, no traceback, no
worker training and nothing overwritten. Most cases run the validation pass (`validate_job`)
in-process; a handful run the CLI itself (`python -m acco.cli`, 2 local workers: slow-marked those
that train or fail in the workers) to check what the user sees."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from validation_helpers import config, validation_error

from acco.config import InputError, compose
from acco.data import synthetic_corpus, train_bpe
from acco.validate import check_output_dir, validate_job

ALPACA = {"instruction": "Say hello.", "input": "", "output": "Hello there!"}


# --------------------------------------------------------------------------- helpers


def cli(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "acco.cli", "launch.nproc=2", f"train.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / 'out'}", "train.nb_steps_tot=16", "train.warmup=0", *overrides,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCO_DEBUG": "", **(env or {})}
    env.pop("ACCO_DEBUG")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("acco: error:")]


def one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    train_bpe(synthetic_corpus(200, seed=0), vocab_size=400).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory) -> Path:
    """A pretrained model's config.json only: the validation pass must not need the weights."""
    from transformers import GPTNeoConfig

    folder = tmp_path_factory.mktemp("pretrained")
    GPTNeoConfig(
        vocab_size=100,
        max_position_embeddings=32,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        attention_types=[[["global", "local"], 1]],
    ).save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- validation, in-process


def test_a_valid_config_passes_without_writing_anything(tmp_path):
    validate_job(config(tmp_path, "train.nb_steps_tot=16"), world_size=2)
    assert not (tmp_path / "out").exists()


def test_missing_empty_unreadable_and_malformed_data(tmp_path):
    msg = validation_error(tmp_path, "data=text", f"data.path={tmp_path / 'nope.jsonl'}")
    assert msg.startswith("data.path:") and "nope.jsonl: no such file" in msg
    msg = validation_error(tmp_path, "data=text")
    assert msg.startswith("missing value for data.path")

    (tmp_path / "empty.txt").write_text("\n\n")
    assert "empty.txt: empty file" in validation_error(
        tmp_path, "data=text", f"data.path={tmp_path / 'empty.txt'}"
    )
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    msg = validation_error(tmp_path, "data=text", f"data.path={tmp_path / 'latin1.txt'}")
    assert "latin1.txt: not UTF-8 text" in msg
    (tmp_path / "no-data").mkdir()
    assert "folder has no" in validation_error(tmp_path, "data=text", f"data.path={tmp_path / 'no-data'}")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert "bad.jsonl, line 2: malformed JSON" in validation_error(tmp_path, "data=text", f"data.path={bad}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_data_file_without_read_permission(tmp_path):
    locked = tmp_path / "locked.txt"
    locked.write_text("some text\n")
    locked.chmod(0)
    msg = validation_error(tmp_path, "data=text", f"data.path={locked}")
    assert msg.startswith("data.path:") and "locked.txt" in msg


def test_instruction_records_without_instruction_or_output(tmp_path):
    data = write_jsonl(tmp_path / "ft.jsonl", [ALPACA, {"instruction": "Say bye."}, ALPACA])
    msg = validation_error(tmp_path, "train=acco-ft", "data=alpaca", f"data.path={data}")
    assert msg.endswith("ft.jsonl, line 2 (record 1): no 'output' field (fields: instruction)"), msg
    data = write_jsonl(tmp_path / "ft2.jsonl", [{"prompt": "x", "output": "y"}])
    assert "line 1 (record 0): no 'instruction' field (fields: prompt, output)" in validation_error(
        tmp_path, "train=acco-ft", "data=alpaca", f"data.path={data}"
    )
    # the field is there but null, or not text: said so, not that it lacks it
    for value, found in ((None, "null"), (42, "a number (42)")):
        data = write_jsonl(tmp_path / "ft3.jsonl", [ALPACA, ALPACA, {**ALPACA, "output": value}])
        msg = validation_error(tmp_path, "train=acco-ft", "data=alpaca", f"data.path={data}")
        assert msg.endswith(f"ft3.jsonl, line 3 (record 2): 'output' is {found}, not a string"), msg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.batch_size=0", "train.batch_size must be a positive integer, got 0"),
        ("train.nb_steps_tot=-5", "train.nb_steps_tot must be a positive integer, got -5"),
        ("train.learning_rate=0", "train.learning_rate must be a positive finite number, got 0"),
        ("train.learning_rate=fast", "train.learning_rate must be a number, got 'fast'"),
        ("train.learning_rate=inf", "train.learning_rate must be a positive finite number, got inf"),
        ("train.output_dir=", "train.output_dir is empty"),
        (
            "train.max_grad_norm=-1",
            "train.max_grad_norm must be a finite number >= 0 (0 or null: no clipping), got -1",
        ),
        (
            "train.max_grad_norm=inf",
            "train.max_grad_norm must be a finite number >= 0 (0 or null: no clipping), got inf",
        ),
        ("train.max_grad_norm=big", "train.max_grad_norm must be a number, got 'big'"),
        ("train.acco_estimate=nope", "train.acco_estimate must be one of lean, paper, got 'nope'"),
        ("train.batch_size=two", "train.batch_size must be an integer, got 'two'"),
        ("launch.nproc=0", "launch.nproc must be a positive integer or 'auto', got 0"),
        ("launch.nproc=-1", "launch.nproc must be a positive integer or 'auto', got -1"),
        ("launch.nproc=two", "launch.nproc must be a positive integer or 'auto', got 'two'"),
        ("launch.timeout_s=0", "launch.timeout_s must be a positive finite number, got 0"),
        ("train.scheduler_name=nope", "scheduler"),
        ("train.max_length=1000", "train.max_length 1000 exceeds model.max_position_embeddings 256"),
        ("train=base", "missing value for train.method_name"),
        ("model.attn_implementation=foo", "attn_implementation='foo' is not an attention transformers knows"),
        ("train.max_eval_batches=0", "train.max_eval_batches must be null or a positive integer, got 0"),
        ("train.eval_batch_size=0", "train.eval_batch_size must be null or a positive integer, got 0"),
        ("train.seed=-1", "train.seed must be a non-negative integer, got -1"),
        ("train.eval_fraction=0", "train.eval_fraction=0 leaves no eval set to carve"),
        ("data.path=corpus.txt", "data.path='corpus.txt' with data=synthetic, which generates its corpus"),
    ],
)
def test_bad_values_name_their_key(tmp_path, override, expected):
    assert expected in validation_error(tmp_path, override)


def test_gpt_neo_flash_attention_refused_where_its_local_layers_need_their_window(tmp_path):
    flash = "model.attn_implementation=flash_attention_2"
    msg = validation_error(tmp_path, flash, "model.window_size=16")  # the tiny recipe's max_length 64
    assert msg.startswith(f"{flash}: transformers' GPT-Neo flash-attention has no sliding window")
    assert "beyond model.window_size 16 at train.max_length 64; use sdpa (the default)" in msg
    # fine where the window holds every key, or where no layer is local
    for fine in (["model.window_size=64"], ["model.window_size=16", "model.attention_types=[[[global],2]]"]):
        validate_job(config(tmp_path, flash, *fine, "train.nb_steps_tot=16"), world_size=2)


def test_tokenizer_folder_not_found(tmp_path):
    msg = validation_error(tmp_path, f"model.tokenizer={tmp_path / 'no-tokenizer'}")
    assert msg.startswith("model.tokenizer:") and "no-tokenizer" in msg and "no such folder" in msg


def test_pretrained_model_checked_from_its_config_alone(tmp_path, tokenizer_dir, pretrained_dir):
    msg = validation_error(tmp_path, f"model.pretrained={tmp_path / 'no-model'}")
    assert msg == f"model.pretrained '{tmp_path / 'no-model'}': no such folder"
    (tmp_path / "empty-model").mkdir()
    assert "has no config.json" in validation_error(tmp_path, f"model.pretrained={tmp_path / 'empty-model'}")

    msg = validation_error(tmp_path, f"model.pretrained={pretrained_dir}", f"model.tokenizer={tokenizer_dir}")
    assert "train.max_length 64 exceeds the 32 positions" in msg  # the tiny recipe's 64

    msg = validation_error(
        tmp_path,
        f"model.pretrained={pretrained_dir}",
        f"model.tokenizer={tokenizer_dir}",
        "train.max_length=32",
    )
    assert f"model.tokenizer '{tokenizer_dir}' has 400 tokens, more than the 100 rows of the embedding" in msg
    msg = validation_error(tmp_path, f"model.pretrained={pretrained_dir}", "train.max_length=32",
                          "model.tokenizer=bpe")
    assert "model.tokenizer=bpe (model.vocab_size) has 2048 tokens, more than the 100 rows" in msg
    # by default a pretrained model's tokenizer is the one saved with it
    msg = validation_error(tmp_path, f"model.pretrained={pretrained_dir}", "train.max_length=32")
    assert msg.startswith(f"model.pretrained '{pretrained_dir}' has no tokenizer (")
    assert msg.endswith("name one with model.tokenizer=PATH_OR_HUB_NAME")


def test_dataset_smaller_than_one_global_batch(tmp_path, tokenizer_dir):
    msg = validation_error(tmp_path, "data.n_docs=5")
    assert msg.startswith("dataset too small: data.n_docs gives")
    assert "fewer than one global batch of train.batch_size 8 x 2 worker(s) = 16" in msg

    cached = set((tmp_path / "cache").glob("tokens-v2-*.npy"))
    text = tmp_path / "short.txt"
    text.write_text("\n\n".join(synthetic_corpus(10, seed=1)))
    msg = validation_error(
        tmp_path, "data=text", f"data.path={text}", f"model.tokenizer={tokenizer_dir}", "train.batch_size=32"
    )
    assert msg.startswith(f"dataset too small: data.path '{text}' gives") and "= 64" in msg
    # the blocks packed here went to the cache, where the workers will find them
    assert len(set((tmp_path / "cache").glob("tokens-v2-*.npy")) - cached) == 1

    data = write_jsonl(tmp_path / "ft.jsonl", [ALPACA] * 12)
    msg = validation_error(
        tmp_path,
        "train=acco-ft",
        "data=alpaca",
        f"data.path={data}",
        "train.batch_size=4",
        "launch.nproc=4",
        "train.max_length=128",
    )
    assert "11 instruction examples" in msg and "in its training split" in msg and "= 16" in msg


def test_output_dir_that_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    msg = validation_error(tmp_path, f"train.output_dir={tmp_path / 'file' / 'run'}")
    assert msg == (
        f"train.output_dir '{tmp_path / 'file' / 'run'}' cannot be created: '{tmp_path / 'file'}' is a file, "
        "not a folder"
    )
    assert "is a file, not a folder" in validation_error(tmp_path, f"train.output_dir={tmp_path / 'file'}")
    msg = validation_error(tmp_path, f"train.cache_dir={tmp_path / 'file' / 'cache'}")
    assert msg.startswith(f"train.cache_dir '{tmp_path / 'file' / 'cache'}' cannot be created")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("acco.validate.tempfile.mkstemp", read_only)
    with pytest.raises(
        InputError, match=r"train.output_dir '.*/a/b' is not writable \(in '.*'\): Read-only file system"
    ):
        check_output_dir(str(tmp_path / "a" / "b"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_output_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert "is not writable" in validation_error(tmp_path, f"train.output_dir={locked / 'run'}")


def test_output_dir_holding_a_run_is_not_overwritten_unless_asked(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"old": true}')
    msg = validation_error(tmp_path)
    assert msg.startswith(f"train.output_dir '{out}' already holds a run (summary.json)")
    assert "train.overwrite_output_dir=true" in msg
    validate_job(config(tmp_path, "train.overwrite_output_dir=true", "train.nb_steps_tot=16"), world_size=2)
    check_output_dir(str(out), resume="latest")
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("")  # a run stopped before its first checkpoint: no `latest`
    assert validation_error(tmp_path).endswith(
        "(metrics.jsonl); choose another train.output_dir or set train.overwrite_output_dir=true to replace "
        "it (it has no complete checkpoint to continue from)")
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "meta.json").write_text("{}")
    assert validation_error(tmp_path).endswith(
        "(metrics.jsonl, checkpoint-2); choose another train.output_dir or set train.overwrite_output_dir="
        "true to replace it, or train.resume_from_checkpoint=latest to continue it")
    (out / "metrics.jsonl").unlink()
    (out / "checkpoint-2").rename(tmp_path / "checkpoint-2")  # out of the way
    (out / "config.yaml").write_text("")  # a run that failed before training may start again
    (out / "tokenizer").mkdir()
    check_output_dir(str(out))


def test_the_checks_that_cost_nothing_are_reported_together(tmp_path):
    """A missing data file is not hidden behind an output folder that holds a run, nor a missing
    pretrained folder behind either: every check that costs nothing runs, a line each."""
    out, missing, no_model = tmp_path / "out", tmp_path / "missing.jsonl", tmp_path / "no-model"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    with pytest.raises(InputError) as info:
        validate_job(config(tmp_path, "data=text", f"data.path={missing}", f"model.pretrained={no_model}"))
    lines = str(info.value).split("\n")
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"train.output_dir '{out}' already holds a run (summary.json)")
    assert lines[1:] == [f"data.path: {missing}: no such file or folder",
                         f"model.pretrained '{no_model}': no such folder"]  # fmt: skip
    # a new model's positions, and the BPE's size, with the data file
    with pytest.raises(InputError) as info:
        validate_job(config(tmp_path, "train.overwrite_output_dir=true", "data=text", f"data.path={missing}",
                            "train.max_length=512", "model.vocab_size=100"))  # fmt: skip
    assert str(info.value).split("\n") == [
        f"data.path: {missing}: no such file or folder",
        "model.vocab_size must be an integer above 257 for model.tokenizer=bpe, got 100",
        "train.max_length 512 exceeds model.max_position_embeddings 256 (model 'tiny')",
    ]


def test_auto_with_no_checkpoint_starts_afresh_but_never_over_a_finished_run(tmp_path):
    """resume_from_checkpoint=auto: a run stopped before its first checkpoint starts again; a
    finished one without checkpoints (train.save=false) is kept, as without auto."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    check_output_dir(str(out), resume="auto")
    (out / "summary.json").write_text('{"old": true}')
    msg = validation_error(tmp_path, "train.resume_from_checkpoint=auto")
    assert msg.startswith(f"train.output_dir '{out}' holds a finished run (summary.json) and no checkpoint")
    check_output_dir(str(out), resume="auto", overwrite=True)
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "meta.json").write_text("{}")
    check_output_dir(str(out), resume="auto")  # a checkpoint to continue (what it holds: check_resumable)


def test_unknown_config_group_option_or_key(tmp_path):
    # a misspelt name gets the closest known one, with its group, and the group's three closest
    # keys (difflib's; not all 53 of train); a name close to none gets no guess
    said = (r"^unknown config key 'train\.batch_sise' in 'train\.batch_sise=4' \(did you mean "
            r"'train\.batch_size'\?\); closest keys of train: batch_size, eval_batch_size, async_save$")
    with pytest.raises(InputError, match=said):
        compose(["train.batch_sise=4"])
    with pytest.raises(
        InputError,
        match=r"^unknown config key 'trian' in 'trian=acco' \(did you mean 'train'\?\); keys at the top "
        r"level: train, model, data, launch$",
    ):
        compose(["trian=acco"])
    with pytest.raises(InputError, match=r"^unknown config key 'lanch' in 'lanch\.nproc=2' \(did you mean "):
        compose(["lanch.nproc=2"])
    said = r"^unknown config key 'train\.lerning_rate' in '\+train\.lerning_rate=1' "
    with pytest.raises(InputError, match=said + r"\(did you mean 'train\.learning_rate'\?\); closest keys "):
        compose(["+train.lerning_rate=1"])  # Hydra adds it; acco's own check refuses it
    with pytest.raises(
        InputError,
        match=r"^unknown model 'gpt9': no config model/gpt9.yaml \(available: gptneo-125m, .*tiny\)$",
    ):
        compose(["model=gpt9"])
    with pytest.raises(InputError, match=r"^unknown model 'gptneo-125' \(did you mean 'gptneo-125m'\?\): "):
        compose(["model=gptneo-125"])
    with pytest.raises(InputError, match=r"^cannot parse override"):
        compose(["train.batch_size=[1,"])
    compose(["train=ddp", "model=gptneo-36m", "launch.nproc=3"])
    # no method, and the default output_dir names it: the one line says what is missing
    with pytest.raises(InputError, match=r"^missing value for train.method_name: set train\.method_name="):
        validate_job(compose(["train=base"]))


@pytest.mark.parametrize("typed", ["lerning_rate", "lr", "eval_steps_every", "zzz"])
def test_an_unknown_keys_line_is_short_and_names_the_three_closest(typed):
    """On the command line and in the Python API alike: under 200 characters (the whole list of
    train's keys made it about 900), with the three keys difflib finds closest."""
    import dataclasses
    import difflib

    from acco.config import SEED_ONLY_KEYS, ConfigError, TrainArgs

    keys = [f.name for f in dataclasses.fields(TrainArgs) if f.name not in SEED_ONLY_KEYS]
    closest = ", ".join(difflib.get_close_matches(typed, keys, n=3, cutoff=0.0))
    with pytest.raises(InputError) as cli_error:
        compose([f"train.{typed}=1"])
    with pytest.raises(ConfigError) as api_error:
        TrainArgs.from_any({typed: 1})
    for line in (str(cli_error.value), str(api_error.value)):
        assert len(line) < 200 and "\n" not in line, line
        assert line.endswith(f"; closest keys of train: {closest}"), line
    if typed == "lerning_rate":  # one close enough to be the one meant: named first
        assert "(did you mean 'learning_rate'?)" in str(api_error.value)
    long_value = compose_error([f"+train.{typed}={'x' * 400}"])  # the value typed is cut, not the hint
    assert len(long_value) < 200 and long_value.endswith(closest), long_value


def compose_error(overrides: list[str]) -> str:
    with pytest.raises(InputError) as info:
        compose(overrides)
    return str(info.value)


# --------------------------------------------------------------------------- the CLI as users run it


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.nb_steps=10", "unknown config key 'train.nb_steps' in 'train.nb_steps=10'"),
        ("+train.learning_rat=1", "unknown config key 'train.learning_rat' in '+train.learning_rat=1'"),
        ("++model.foo=2", "unknown config key 'model.foo' in '++model.foo=2'; closest keys of model: "),
        ("+foo=1", "unknown config key 'foo' in '+foo=1'; keys at the top level: data, launch, model, train"),
        ("data=wikipedia", "unknown data 'wikipedia': no config data/wikipedia.yaml (available: alpaca"),
    ],
)
def test_cli_unknown_key_or_group_is_one_line(tmp_path, override, expected):
    proc = cli(tmp_path, override)
    one_error(proc, expected)
    assert proc.stderr.strip() == one_error(proc)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("launch.nproc=0", "launch.nproc must be a positive integer or 'auto', got 0"),
        ("launch.nproc=-1", "launch.nproc must be a positive integer or 'auto', got -1"),
        ("launch.nproc=two", "launch.nproc must be a positive integer or 'auto', got 'two'"),
        ("launch.timeout_s=0", "launch.timeout_s must be a positive finite number, got 0"),
    ],
)
def test_cli_bad_launch_value_is_one_line_before_any_worker(tmp_path, override, expected):
    """The launcher reads launch.* before the validation pass: the schema's checks must have run
    when the config was composed (a structured config runs no __post_init__ as Hydra merges)."""
    proc = cli(
        tmp_path, "model=tiny", "train.nb_steps_tot=8", "train.batch_size=2", "train.max_length=32", override
    )
    assert proc.stderr.strip() == one_error(proc, expected)
    assert not (tmp_path / "out").exists()


def test_cli_malformed_data_starts_no_worker_and_overwrites_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"\n')
    proc = cli(tmp_path, "data=text", f"data.path={bad}")
    line = one_error(proc, "corpus.jsonl, line 2: malformed JSON")
    assert line.startswith("acco: error: data.path: ")  # the launcher's line, no rank, no type
    assert proc.stderr.strip() == line  # datasets' own "Failed to load JSON" log is not repeated
    assert (
        sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    )


def test_cli_finished_run_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"final_eval_loss": 1.0}')
    proc = cli(tmp_path)
    one_error(proc, f"train.output_dir '{out}' already holds a run", "train.overwrite_output_dir=true")
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
    assert (out / "summary.json").read_text() == '{"final_eval_loss": 1.0}'


def test_cli_says_every_cheap_problem_before_starting_a_worker(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"final_eval_loss": 1.0}')
    proc = cli(tmp_path, "data=text", f"data.path={tmp_path / 'missing.jsonl'}")
    assert error_lines(proc) == [
        f"acco: error: train.output_dir '{out}' already holds a run (summary.json); choose another "
        "train.output_dir or set train.overwrite_output_dir=true to replace it (it has no complete "
        "checkpoint to continue from)",
        f"acco: error: data.path: {tmp_path / 'missing.jsonl'}: no such file or folder",
    ]
    assert proc.stderr == "".join(line + "\n" for line in error_lines(proc)) and proc.stdout == ""
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


@pytest.mark.slow
def test_cli_hub_tokenizer_that_cannot_be_found_offline(tmp_path):
    proc = cli(tmp_path, "model.tokenizer=acco-tests/no-such-tokenizer")
    one_error(proc, "model.tokenizer: cannot load tokenizer 'acco-tests/no-such-tokenizer'")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two 2-worker jobs that fail in their workers
def test_cli_worker_side_error_stays_short(tmp_path):
    """Validation cannot size 128-byte words (a BPE token each) cheaply: a line per rank, the launcher's."""
    text = tmp_path / "long-words.txt"
    text.write_text("\n\n".join(" ".join(["x" * 127 + "y", "z" * 127 + "w"] * 8) for _ in range(14)))
    proc = cli(tmp_path, "data=text", f"data.path={text}", "model.vocab_size=400", "train.eval=false")
    lines = error_lines(proc)
    assert 1 <= len(lines) <= 2, proc.stderr
    too_small = r"acco: error: \[rank \d\] dataset has \d+ samples, fewer than one global batch"
    assert all(re.match(too_small, line) for line in lines), lines
    # with an eval split: its one document is shorter than a block, and the message says so, as
    # the line of an input error (no exception class in it)
    lines = error_lines(cli(tmp_path, "data=text", f"data.path={text}", "model.vocab_size=400"))
    assert lines and all(re.match(r"acco: error: \[rank \d\] the eval set: the corpus gives", line)
                         and "train.eval_fraction" in line for line in lines), lines
    assert sum("acco.launch: rank" in line for line in proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.slow  # a job under torchrun
def test_under_torchrun_rank0_alone_validates_and_the_others_follow(tmp_path):
    """No local launcher: rank 0 runs the validation pass while rank 1 waits on the store; the
    one line comes from rank 0, rank 1 exits without repeating it, nothing is written."""
    from acco.launch import free_port

    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"\n')
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "acco.cli", f"train.cache_dir={tmp_path / 'cache'}",
        f"train.output_dir={tmp_path / 'out'}", "data=text", f"data.path={bad}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "ACCO_DEBUG")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("acco: error:")]
    assert len(lines) == 1 and lines[0].startswith("acco: error: [rank 0] data.path: "), proc.stderr[-3000:]
    assert "corpus.jsonl, line 2: malformed JSON" in lines[0] and not (tmp_path / "out").exists()
