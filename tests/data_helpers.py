"""Shared by the data tests: a byte-level tokenizer whose ids are known from the text alone."""

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

EOT = "<|endoftext|>"


def _bytes_to_unicode():
    """GPT-2's printable stand-in character for each byte (what the ByteLevel pre-tokenizer emits)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """Byte b -> id b + 1, eos -> 0, pad -> 257 (and, with `bos`, a bos 258 that the tokenizer puts
    in front of every text, as Llama 3's does). No merges, so every byte is one token and expected
    ids can be written from the text alone; pad differs from eos so tests can tell padding from the
    end-of-text label."""
    vocab = {EOT: 0, **{ch: b + 1 for b, ch in _bytes_to_unicode().items()}, "<pad>": 257}
    if bos:
        vocab["<bos>"] = 258
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if not bos:
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token="<pad>",
                                       clean_up_tokenization_spaces=False)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 258)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=EOT, pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def byte_ids(text: str) -> list[int]:
    return [b + 1 for b in text.encode("utf-8")]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
