from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from acco.models import ModelError, build_model, count_parameters, flops_per_token, model_config

CONF = Path(__file__).resolve().parents[1] / "acco" / "conf" / "model"
SCHEMA = {
    "gpt_neo": {
        "name",
        "arch",
        "hidden_size",
        "num_layers",
        "num_heads",
        "max_position_embeddings",
        "window_size",
        "pretrained",
        "tokenizer",
        "vocab_size",
    },
    "llama": {
        "name",
        "arch",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rope_theta",
        "pretrained",
        "tokenizer",
        "vocab_size",
    },
}


def load(name):
    return OmegaConf.load(CONF / f"{name}.yaml")


# name -> (vocab used, expected parameters, relative tolerance)
EXPECTED = {
    "tiny": (2048, 247_168, 0.0),
    "gptneo-36m": (10_000, 36e6, 0.05),
    "gptneo-125m": (50_257, 125.2e6, 0.01),  # EleutherAI/gpt-neo-125M
    "gptneo-2.7b": (50_257, 2.65e9, 0.02),  # EleutherAI/gpt-neo-2.7B
    "llama3": (128_256, 1.236e9, 0.01),  # meta-llama/Llama-3.2-1B
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_yaml_builds_with_expected_size(name):
    cfg = load(name)
    assert cfg.name == name
    assert set(cfg.keys()) == SCHEMA[cfg.arch]
    assert cfg.pretrained is None
    vocab, expected, tol = EXPECTED[name]
    with torch.device("meta"):
        model = build_model(cfg, vocab)
    n = count_parameters(model)
    assert abs(n - expected) <= tol * expected, (name, n)
    assert model.get_input_embeddings().num_embeddings == vocab
    assert model.config.max_position_embeddings == cfg.max_position_embeddings
    # a config-only estimate agrees with the model's
    assert flops_per_token(model, 512) == flops_per_token(model_config(cfg, vocab), 512)


def test_gpt_neo_attention_alternates_global_local():
    model_125m = model_config(load("gptneo-125m"), 50257)
    assert model_125m.attention_layers == ["global", "local"] * 6
    assert model_125m.window_size == 256
    odd = model_config({**OmegaConf.to_container(load("tiny")), "num_layers": 3}, 100)
    assert odd.attention_layers == ["global", "local", "global"]


def test_llama_config_fields():
    cfg = model_config(load("llama3"), 128256)
    assert cfg.num_key_value_heads == 8 and cfg.num_attention_heads == 32
    assert cfg.intermediate_size == 8192
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 500000.0
    assert cfg.tie_word_embeddings


def tiny_llama():
    return {
        "name": "tiny-llama",
        "arch": "llama",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "pretrained": None,
        "tokenizer": "bpe",
        "vocab_size": 97,
    }


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_tiny_forward_backward(arch):
    torch.manual_seed(0)
    cfg = load("tiny") if arch == "gpt_neo" else tiny_llama()
    model = build_model(cfg, 97, max_length=32)
    ids = torch.randint(0, 97, (2, 32))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 32, 97)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - torch.log(torch.tensor(97.0)).item()) < 1.0
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.config._attn_implementation in ("eager", "sdpa")


def test_vocab_and_special_ids_from_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<pad>", "<eos>"])
    tok.train_from_iterator(["once upon a time there was a tiny model"] * 50, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    model = build_model(
        load("tiny"), len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == 2
    assert model.config.pad_token_id == 1
    assert model.config.bos_token_id is None
    # no vocab given: the config's own vocab_size
    assert build_model(load("tiny"), None).config.vocab_size == 2048


@pytest.mark.parametrize("arch", ["gpt_neo", "llama"])
def test_pretrained_folder_reload_identical_logits(tmp_path, arch):
    torch.manual_seed(1)
    cfg = OmegaConf.to_container(load("tiny")) if arch == "gpt_neo" else tiny_llama()
    model = build_model(cfg, 97, eos_token_id=3).eval()
    model.save_pretrained(tmp_path / "m")
    reloaded = build_model({**cfg, "pretrained": str(tmp_path / "m")}, 97, max_length=64).eval()
    assert type(reloaded) is type(model)
    assert reloaded.config.eos_token_id == 3
    assert reloaded.dtype == torch.float32
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    # a smaller tokenizer fits a larger embedding
    build_model({**cfg, "pretrained": str(tmp_path / "m")}, 90)
    # a larger one does not
    with pytest.raises(ModelError, match=r"tokenizer vocabulary \(98 tokens\) is larger .* \(97 rows\)"):
        build_model({**cfg, "pretrained": str(tmp_path / "m")}, 98)
    limit = cfg["max_position_embeddings"]
    with pytest.raises(
        ModelError, match=f"max_length {limit + 1} exceeds .*max_position_embeddings \\({limit}\\)"
    ):
        build_model({**cfg, "pretrained": str(tmp_path / "m")}, 97, max_length=limit + 1)


def test_model_errors(tmp_path):
    cfg = OmegaConf.to_container(load("tiny"))
    with pytest.raises(
        ModelError, match="max_length 257 exceeds the model's max_position_embeddings \\(256\\)"
    ):
        build_model(cfg, 100, max_length=257)
    build_model(cfg, 100, max_length=256)
    with pytest.raises(ModelError, match="unknown model arch 'gpt2'"):
        build_model({**cfg, "arch": "gpt2"}, 100)
    with pytest.raises(ModelError, match="needs 'hidden_size'"):
        build_model({k: v for k, v in cfg.items() if k != "hidden_size"}, 100)
    with pytest.raises(ModelError, match="not a multiple of num_heads"):
        build_model({**cfg, "num_heads": 5}, 100)
    with pytest.raises(ModelError, match="eos_token_id 100 is outside the vocabulary"):
        build_model(cfg, 100, eos_token_id=100)
    with pytest.raises(ModelError, match="pretrained model folder .* not found") as info:
        build_model({**cfg, "pretrained": str(tmp_path / "missing")}, 100)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_flops_per_token_formula():
    cfg = load("tiny")
    model = build_model(cfg, 2048)
    n = count_parameters(model)
    # GPT-Neo ties the token embedding to the output head (kept) and has lookup-only positions
    n_matmul = n - cfg.max_position_embeddings * cfg.hidden_size
    expected = 6 * n_matmul + 12 * cfg.num_layers * cfg.num_heads * (cfg.hidden_size // cfg.num_heads) * 128
    assert flops_per_token(model, 128) == expected
    assert flops_per_token(cfg, 128) == expected
    # an untied llama: the input embedding is a lookup, the head a matmul
    untied = build_model({**tiny_llama(), "tie_word_embeddings": False}, 97)
    n = count_parameters(untied)
    assert flops_per_token(untied, 10) == 6 * (n - 97 * 32) + 12 * 2 * 4 * 8 * 10
    assert count_parameters(untied, trainable_only=True) == n


def test_configs_compose_with_hydra():
    from hydra import compose, initialize_config_dir

    import acco.conf  # noqa: F401  (the resolvers)

    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        cfg = compose(overrides=["+model=gptneo-125m", "model.pretrained=/some/local/copy"])
    assert cfg.model.name == "gptneo-125m" and cfg.model.pretrained == "/some/local/copy"
    assert model_config(cfg.model).vocab_size == 50257
    # a pretrained model brings its own tokenizer, unless one is named
    assert cfg.model.tokenizer == "/some/local/copy"
    with initialize_config_dir(config_dir=str(CONF.parent), version_base="1.3"):
        plain = compose(overrides=["+model=gptneo-125m"])
        named = compose(overrides=["+model=tiny", "model.pretrained=/p", "model.tokenizer=/tok"])
    assert plain.model.tokenizer == "EleutherAI/gpt-neo-125M"
    assert named.model.tokenizer == "/tok"


@pytest.mark.parametrize("arch, device, half, flash, expected", [
    # GPT-Neo never gets flash-attention-2: transformers' GPT-Neo flash path has no sliding window
    ("gpt_neo", "cuda", True, True, "sdpa"),
    ("gpt_neo", "cuda", True, False, "sdpa"),
    ("gpt_neo", "cuda", False, True, "sdpa"),
    ("gpt_neo", "cuda", False, False, "sdpa"),
    ("gpt_neo", "cpu", True, True, "sdpa"),
    ("gpt_neo", "cpu", True, False, "sdpa"),
    ("gpt_neo", "cpu", False, True, "sdpa"),
    ("gpt_neo", "cpu", False, False, "sdpa"),
    ("llama", "cuda", True, True, "flash_attention_2"),
    ("llama", "cuda", True, False, "sdpa"),
    ("llama", "cuda", False, True, "sdpa"),  # flash-attention needs bf16 or fp16
    ("llama", "cuda", False, False, "sdpa"),
    ("llama", "cpu", True, True, "sdpa"),
    ("llama", "cpu", True, False, "sdpa"),
    ("llama", "cpu", False, True, "sdpa"),
    ("llama", "cpu", False, False, "sdpa"),
])  # fmt: skip
def test_attention_is_chosen_for_the_device(monkeypatch, arch, device, half, flash, expected):
    import importlib.util

    from acco.models import attention_for

    real, spec = importlib.util.find_spec, object() if flash else None
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: spec if name == "flash_attn" else real(name, *a)
    )
    assert attention_for(arch, device, half) == expected


def test_attention_of_a_built_model():
    from acco.models import attention_of

    neo = dict(arch="gpt_neo", hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
               window_size=8)  # fmt: skip
    assert attention_of(build_model(neo, vocab_size=97)) == "sdpa"  # the default: swapped in
    assert attention_of(build_model(neo | {"attn_implementation": "eager"}, vocab_size=97)) == "eager"
    config = dict(arch="llama", hidden_size=32, num_layers=1, num_heads=4, max_position_embeddings=64,
                  intermediate_size=64, attn_implementation="eager")  # fmt: skip
    assert build_model(config, vocab_size=97).config._attn_implementation == "eager"  # the user's choice


def test_a_transformers_older_than_the_tested_ones_is_refused_in_one_line():
    from acco.models import MIN_TRANSFORMERS, check_transformers

    check_transformers(MIN_TRANSFORMERS + ".0")
    check_transformers("5.23.0")
    for old in ("5.0.0", "4.57.3", "5.16.1"):
        want = rf"^acco needs transformers >= 5\.17, this environment has {old}: pip install"
        with pytest.raises(ImportError, match=want):
            check_transformers(old)
