"""Tokenizers: byte-level by default, or a Hugging Face `tokenizers` JSON file (a path, or `hf:DIR` for a
model directory's tokenizer.json)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from raydist.errors import ConfigError


class ByteTokenizer:
    """Bytes 0-255 are their own ids; 256 marks the end of a document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: bytes | str, add_special_tokens: bool = False) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        """Bytes back to text (ids >= 256, end-of-document or beyond the vocabulary, are dropped)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class JsonTokenizer:
    """A `tokenizers` library JSON file (BPE, WordPiece, ...); the end-of-document id is the first of
    a few common special tokens the file defines, else one past the vocabulary."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - depends on the environment
            raise ConfigError(f"data.tokenizer={path!r} needs the `tokenizers` package: pip install tokenizers") from None
        import fsspec

        try:
            with fsspec.open(path, "r") as f:
                self._tok = Tokenizer.from_str(f.read())
        except FileNotFoundError:
            raise ConfigError(f"data.tokenizer={path!r} not found; give a tokenizers JSON file, hf:DIR (a model "
                              "directory holding tokenizer.json) or 'byte'") from None
        except Exception as exc:  # tokenizers raises its own exception type for bad files
            raise ConfigError(f"data.tokenizer={path!r} is not a tokenizers JSON file: {exc}") from None
        self.name = path
        vocab = self._tok.get_vocab_size(with_added_tokens=True)
        eos = next((self._tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>", "[SEP]")
                    if self._tok.token_to_id(t) is not None), None)
        self.eos_id = vocab if eos is None else eos
        self.vocab_size = max(vocab, self.eos_id + 1)

    def encode(self, text: bytes | str, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids; `add_special_tokens` applies the file's post-processor (e.g. a Llama tokenizer's
        begin-of-text token, as a model expects at the start of a prompt)."""
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def describe(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def tokenizer_path(spec: str) -> str:
    """The tokenizers JSON file a spec names: `hf:DIR` -> DIR/tokenizer.json, a path as it is."""
    if spec.startswith("hf:"):
        if not spec[3:]:
            raise ConfigError(f"data.tokenizer={spec!r}: give the model directory, e.g. hf:./Llama-3.2-1B")
        return spec[3:].rstrip("/") + "/tokenizer.json"
    return spec


def get_tokenizer(spec: str):
    """`byte`, a tokenizers JSON file, or `hf:DIR` (a Hugging Face model directory's tokenizer.json)."""
    return ByteTokenizer() if spec == "byte" else JsonTokenizer(tokenizer_path(spec))


def check_data_tokenizer(hf_dir: str | os.PathLike, data_tokenizer: dict, data_path: str) -> None:
    """ConfigError when `hf_dir` holds a tokenizer.json and `data_path` was tokenized with another one (the
    manifest's vocabulary size or end-of-sequence id differ from that file's): token ids of another
    vocabulary index the model's embedding without any shape error, so nothing else would catch it.
    A directory without tokenizer.json, or no `tokenizers` package to read it, leaves only the size check
    (data vocabulary <= model.vocab_size) that the callers make."""
    import importlib.util

    if not (Path(hf_dir) / "tokenizer.json").is_file() or importlib.util.find_spec("tokenizers") is None:
        return
    own = get_tokenizer(f"hf:{hf_dir}").describe()
    if (own["vocab_size"], own["eos_id"]) == (data_tokenizer["vocab_size"], data_tokenizer["eos_id"]):
        return
    raise ConfigError(f"{data_path} was tokenized with {data_tokenizer['name']} (vocabulary of "
                      f"{data_tokenizer['vocab_size']}, end-of-sequence id {data_tokenizer['eos_id']}) but hf:{hf_dir} "
                      f"has its own tokenizer.json (vocabulary of {own['vocab_size']}, end-of-sequence id "
                      f"{own['eos_id']}); prepare the data with the model's tokenizer "
                      f"(data.tokenizer = \"hf:{hf_dir}\")")
