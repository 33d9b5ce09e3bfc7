"""Tokenizers: the built-in countdown vocabulary and tokenizer.json loading."""

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from zerokl.tokenizer import CountdownTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from zerokl.tasks.countdown import format_demonstration, format_prompt, generate_problems


def test_countdown_vocab():
    tok = CountdownTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(set(tok.TOKENS)) == 34
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("<answer>") == [4] and tok.encode("</answer>") == [5]  # single tokens


def test_countdown_round_trip_all_problems():
    tok = CountdownTokenizer()
    for split in ("train", "test"):
        for p in generate_problems(200, seed=0, split=split):
            text = format_prompt(p) + format_demonstration(p)
            ids = tok.encode(text)
            assert tok.unk_id not in ids
            assert tok.decode(ids) == text
            assert len(ids) < 64  # fits a tiny model's context with room to spare


def test_countdown_unknown_and_specials():
    tok = CountdownTokenizer()
    a = tok.TOKENS.index("a")
    assert tok.encode("x<a>b") == [tok.unk_id, tok.unk_id, a, tok.unk_id, tok.unk_id]
    ids = [tok.bos_id, *tok.encode("nums 1"), tok.eos_id, tok.pad_id, tok.unk_id]
    assert tok.decode(ids) == "nums 1"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        tok.decode([-1])


def _save_bpe(path, special_tokens):
    """Train a tiny byte-level BPE on a few strings and save it as tokenizer.json."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["nums 3 5 2 target 16", "<answer>(3+5)*2</answer>", "hello"], trainer)
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    return raw


def test_hf_tokenizer_well_known_names(tmp_path):
    raw = _save_bpe(tmp_path, ["<s>", "</s>", "<pad>"])
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == raw.get_vocab_size()
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    text = "nums 3 5 2 target 16\n<answer>(3+5)*2</answer> héllo"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).encode(text) == ids


def test_hf_tokenizer_fallbacks_to_eos(tmp_path):
    _save_bpe(tmp_path, ["<|endoftext|>"])
    tok = HFTokenizer(tmp_path)
    assert tok.bos_id == tok.eos_id == tok.pad_id == 0


def test_hf_tokenizer_config_overrides(tmp_path):
    raw = _save_bpe(tmp_path, ["<|endoftext|>", "<|user|>", "<pad>"])
    config = {"eos_token": {"content": "<|user|>"}, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_id == raw.token_to_id("<|user|>")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert tok.bos_id == tok.eos_id

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
    with pytest.raises(ValueError):
        HFTokenizer(tmp_path)


def test_hf_tokenizer_errors(tmp_path):
    _save_bpe(tmp_path, ["<unk>"])
    with pytest.raises(ValueError, match="eos"):
        HFTokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_load_countdown():
    assert isinstance(load_tokenizer("countdown"), CountdownTokenizer)
