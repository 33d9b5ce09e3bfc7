"""Tokenizers: one small interface, a built-in countdown vocabulary, and any
Hugging Face tokenizer.json.

Conventions shared by every implementation:
- `encode` maps plain text to ids and never adds special tokens; callers put
  `bos_id` / `eos_id` where their format wants them.
- `decode` drops special tokens (pad, bos, eos, unk), like Hugging Face's
  `skip_special_tokens=True`, so a generated sequence decodes to its text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers

__all__ = ["CountdownTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "write_hf_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the model, services and tasks need from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        ...

    def unknown_pieces(self, text: str) -> list[str]:
        """The pieces of `text` the vocabulary has no token for (`encode` maps them to unk)."""
        ...


class CountdownTokenizer:
    """Character-level vocabulary covering exactly the countdown task's text.

    Ids are fixed (the vocab is part of a checkpoint's meaning): the four special
    tokens, then "<answer>" and "</answer>" as single tokens, then space, newline,
    digits, operators and "=", then the letters of the prompt words "nums" and
    "target". 34 tokens in all. Encoding is greedy longest-match; any other
    character becomes <unk>.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    TOKENS = (
        *SPECIALS,
        *("<answer>", "</answer>", " ", "\n"),
        *"0123456789",
        *"+-*/()=",
        *"aegmnrstu",
    )

    def __init__(self) -> None:
        self.vocab_size = len(self.TOKENS)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(self.SPECIALS))
        self._ids = {tok: i for i, tok in enumerate(self.TOKENS) if tok not in self.SPECIALS}
        # Longest pieces first so "<answer>" wins over its characters; "." (DOTALL)
        # catches any other character, which then maps to <unk>.
        pieces = sorted(self._ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, pieces)) + "|.", re.DOTALL)

    def to_hf(self) -> tokenizers.Tokenizer:
        """The same vocabulary as a Hugging Face ``tokenizers`` object (encodes to the same ids:
        each piece of the same greedy longest-match split, looked up in a word-level table)."""
        hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(self.TOKENS)},
                                                              unk_token="<unk>"))
        hf.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(self._pattern.pattern), "isolated")
        hf.decoder = tokenizers.decoders.Fuse()
        hf.add_special_tokens(list(self.SPECIALS))
        return hf

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens; unknown characters -> unk_id."""
        return [self._ids.get(piece, self.unk_id) for piece in self._pattern.findall(text)]

    def unknown_pieces(self, text: str) -> list[str]:
        """The characters of `text` outside the vocabulary, in order (each becomes unk_id)."""
        return [piece for piece in self._pattern.findall(text) if piece not in self._ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens. Raises ValueError on an id
        outside the vocabulary."""
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside vocab of {self.vocab_size}")
            if i >= len(self.SPECIALS):
                out.append(self.TOKENS[i])
        return "".join(out)


# Well-known names tried, in order, when tokenizer_config.json does not say.
_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>")
_EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded with the `tokenizers` library.

    `path` is the file or a directory holding it. Special ids are resolved per role
    (bos, eos, pad), first rule that applies:
    1. `tokenizer_config.json` beside the file names the token (`bos_token`, ...,
       as a string or an {"content": ...} object); it must exist in the vocab.
    2. The first of the well-known names (e.g. "<s>", "</s>", "<|endoftext|>",
       "<pad>") that is a special token of the file.
    3. bos and pad fall back to eos (GPT-2 style); a missing eos is a ValueError,
       since generation could never stop.
    """

    def __init__(self, path: str | os.PathLike[str]):
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos_id = self._resolve(config.get("eos_token"), _EOS_NAMES, specials)
        if eos_id is None:
            raise ValueError(f"{file}: no eos token found (rules in HFTokenizer docstring)")
        self.eos_id = eos_id
        bos_id = self._resolve(config.get("bos_token"), _BOS_NAMES, specials)
        pad_id = self._resolve(config.get("pad_token"), _PAD_NAMES, specials)
        self.bos_id = eos_id if bos_id is None else bos_id
        self.pad_id = eos_id if pad_id is None else pad_id

    def _resolve(
        self, configured: str | dict | None, names: Sequence[str], specials: set[str]
    ) -> int | None:
        if isinstance(configured, dict):
            configured = configured.get("content")
        if configured:
            token_id = self._tok.token_to_id(configured)
            if token_id is None:
                raise ValueError(f"tokenizer_config.json names {configured!r}, not in the vocab")
            return token_id
        for name in names:
            if name in specials:
                return self._tok.token_to_id(name)
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the file's post-processor (e.g. an added bos) is not applied."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def unknown_pieces(self, text: str) -> list[str]:
        """The pieces of `text` encoded as the model's unk token (none for byte-level vocabularies)."""
        unk = getattr(self._tok.model, "unk_token", None)
        unk_id = self._tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return []
        enc = self._tok.encode(text, add_special_tokens=False)
        return [text[a:b] for (a, b), i in zip(enc.offsets, enc.ids) if i == unk_id]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer by spec: "countdown" gives CountdownTokenizer(); anything
    else is a tokenizer.json file, or a directory holding one, for HFTokenizer."""
    if spec == "countdown":
        return CountdownTokenizer()
    return HFTokenizer(spec)


def write_hf_tokenizer(spec: str, directory: str | os.PathLike[str]) -> Path:
    """Write the tokenizer of ``spec`` (as :func:`load_tokenizer` takes it) as a directory that
    transformers' ``AutoTokenizer.from_pretrained(directory)`` loads offline: tokenizer.json and
    tokenizer_config.json. Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if spec == "countdown":
        CountdownTokenizer().to_hf().save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                  "pad_token": "<pad>", "unk_token": "<unk>"}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        return out
    source = Path(spec)
    source = source / "tokenizer.json" if source.is_dir() else source
    HFTokenizer(source)                     # refuses a file it could not serve (no eos, ...)
    shutil.copyfile(source, out / "tokenizer.json")
    config_file = source.parent / "tokenizer_config.json"
    if config_file.is_file():
        shutil.copyfile(config_file, out / "tokenizer_config.json")
    else:
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
    return out
