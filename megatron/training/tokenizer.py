"""Tokenizers in the shape megatron-core's datasets expect: SentencePiece, Hugging Face, TikToken.

`GPTDataset` and `MegatronDataset` read only a few attributes off `config.tokenizer`:
`vocab_size` (to pick the token dtype), `eod` (document boundaries for position ids and
masks), `pad` (masked out of the loss) and, for collision checks, `eos`. They also hash
`unique_identifiers` into the dataset cache key, so two different tokenizer files never share a
cached index (here: the sha256 of the file's bytes, whatever the library). Every tokenizer here
provides exactly that, plus `tokenize`/`detokenize` for the data scripts and evaluation.

`load_tokenizer(path)` is the one entry point; what `path` names picks the library:

| path | tokenizer |
| --- | --- |
| `*.model`, or a folder with `tokenizer.model` | SentencePiece (`SentencePieceTokenizer` below: a model trained by `scripts/train_tokenizer.py` has pad 0, unk 1, bos 2, eos 3; `eod` is the eos id) |
| `tokenizer.json` (a Hugging Face `tokenizers` file), or a folder with one | megatron-core's `HuggingFaceTokenizer` (`transformers`' fast tokenizer; `eod` is its eos token: from `tokenizer_config.json` beside it, else the first special token of `</s>`, `<|endoftext|>`, `<|end_of_text|>`, `<eos>`, `<|eot_id|>`) |
| a `*.json` list of `{rank, token_bytes, token_str}` (megatron-core's TikToken vocabulary) | megatron-core's `TikTokenTokenizer` (`tiktoken`; 1000 special ids first, `eod` = `</s>`) |

The Hugging Face and TikToken ones are megatron-core's own classes (`megatron.core.tokenizers`,
`MegatronTokenizer.from_pretrained` with the library named), wrapped only to give the content
hash and a `pad` of -1 where the tokenizer has none. SentencePiece stays our own small class:
megatron-core's adds a legacy special-token layer our models were never trained with, and
ours is the oracle of the data round-trip tests (`sentencepiece` called directly).

A missing, unreadable or unusable tokenizer (no end-of-document token, a library not
installed) raises `TokenizerError` — a `DataError`, so every entry point prints it as one
`error:` line and exits 2.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Iterable, List

import warnings

# megatron.core's package import warns four times that TE/apex are absent; they are optional
# accelerators (see README), so the data tools keep that line out of their output.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.core.tokenizers import MegatronTokenizerBase  # noqa: E402

from megatron.training.errors import DataError  # noqa: E402


class TokenizerError(DataError):
    """A tokenizer file is missing, unreadable or lacks a required special token."""


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks (a tokenizer's identity; the scripts'
    data and cloze records use it too)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A SentencePiece model with Megatron's tokenizer interface (eod, pad, vocab_size, ...)."""

    def __init__(self, model_path: str) -> None:
        import sentencepiece

        if not os.path.isfile(model_path):
            raise TokenizerError(f"tokenizer model not found: {model_path}")
        with open(model_path, "rb") as f:
            blob = f.read()
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(blob)
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError variants
            raise TokenizerError(
                f"not a valid SentencePiece model: {model_path} ({exc})"
            ) from None
        if processor.eos_id() < 0:
            raise TokenizerError(
                f"SentencePiece model {model_path} has no </s> (eos) token to use as end of "
                "document; train it with scripts/train_tokenizer.py"
            )
        super().__init__(model_path, {})
        self._sp = processor
        self.path = os.path.abspath(model_path)
        # Identifies the tokenizer in megatron-core's dataset cache hash (see module docstring).
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("sha256", hashlib.sha256(blob).hexdigest()),
            ]
        )

    # --- encoding -------------------------------------------------------------------------
    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text` (no BOS/EOS added; the caller appends `eod` per document)."""
        return self._sp.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of `ids`; exact inverse of `tokenize` for models trained by our script."""
        return self._sp.decode([int(i) for i in ids])

    def apply_chat_template(self, *args, **kwargs):
        """Pretraining tokenizer: there is no chat template."""
        raise NotImplementedError("SentencePieceTokenizer has no chat template")

    # --- vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict:
        return {i: self._sp.id_to_piece(i) for i in range(self.vocab_size)}

    # --- special tokens -------------------------------------------------------------------
    @property
    def eod(self) -> int:
        """End-of-document id (the model's </s>)."""
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        """Pad id, or -1 when the model has none (megatron then uses its own sentinel)."""
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class LibraryTokenizer(MegatronTokenizerBase):
    """A megatron-core library tokenizer (Hugging Face or TikToken) with our dataset interface."""

    def __init__(self, path: str, library: str) -> None:
        from megatron.core.tokenizers import MegatronTokenizer

        self.library, self.path = library, os.path.abspath(path)
        if library == "huggingface":
            # AutoTokenizer reads a folder: the one holding tokenizer.json (and its config, if any)
            folder = os.path.dirname(self.path) if os.path.isfile(self.path) else self.path
            kwargs = {"use_fast": True}
            hashed = os.path.join(folder, "tokenizer.json")
            where = folder
            eos = _end_token(hashed) if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")) else None
            if eos:  # a bare tokenizer.json names no eos: take its end-of-text special token
                kwargs["eos_token"] = eos
        else:
            with open(self.path) as f:
                n = len(json.load(f))
            kwargs = {"num_special_tokens": 1000, "vocab_size": n + 1000}
            hashed = where = self.path
        missing = _missing_package(library)
        if missing:
            raise TokenizerError(f"tokenizer {path} needs the package `{missing}` "
                                 "(pip install -e .[hf])")
        try:
            self._tok = MegatronTokenizer.from_pretrained(tokenizer_path=where,
                                                          metadata_path={"library": library}, **kwargs)
        except Exception as exc:  # library-specific exception types: one message naming the file
            raise TokenizerError(f"not a usable {library} tokenizer: {path} "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        super().__init__(self.path, {})
        if self._tok.eod is None:
            raise TokenizerError(f"tokenizer {path} has no end-of-sequence token to use as end of "
                                 "document (set eos_token in its tokenizer_config.json)")
        self.unique_identifiers = OrderedDict([("class", f"{type(self).__name__}:{library}"),
                                               ("sha256", sha256_file(hashed))])

    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text`, no special tokens added (the caller appends `eod` per document)."""
        return list(self._tok.tokenize(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.library == "tiktoken":
            # megatron-core's TikToken decodes token by token (a character split over two tokens
            # comes out as U+FFFD); tiktoken's own Encoding joins the bytes first
            return self._tok._tokenizer.tokenizer.decode(ids)
        return self._tok.detokenize(ids)

    def apply_chat_template(self, *args, **kwargs):
        return self._tok.apply_chat_template(*args, **kwargs)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.vocab_size)

    @property
    def vocab(self):
        return self._tok.vocab

    @property
    def inv_vocab(self) -> dict:
        return self._tok.inv_vocab

    @property
    def eod(self) -> int:
        return int(self._tok.eod)

    @property
    def eos(self) -> int:
        return int(self._tok.eod)

    @property
    def bos(self) -> int:
        b = self._tok.bos
        return -1 if b is None else int(b)

    @property
    def pad(self) -> int:
        """Pad id, or -1 when the tokenizer has none (megatron then uses its own sentinel)."""
        p = self._tok.pad
        return -1 if p is None else int(p)

    @property
    def unk(self) -> int:
        u = self._tok.unk
        return -1 if u is None else int(u)

    def __repr__(self) -> str:
        return f"LibraryTokenizer({self.path!r}, {self.library}, vocab_size={self.vocab_size})"


END_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


def _end_token(tokenizer_json: str) -> str | None:
    """The end-of-text special token of a bare tokenizer.json (no tokenizer_config.json beside it
    says which one is eos): the first of END_TOKENS among its special added tokens."""
    try:
        with open(tokenizer_json) as f:
            added = {t.get("content") for t in json.load(f).get("added_tokens", []) if t.get("special")}
    except (OSError, ValueError, AttributeError):
        return None
    return next((t for t in END_TOKENS if t in added), None)


def _missing_package(library: str) -> str | None:
    import importlib.util

    need = {"huggingface": ("transformers", "tokenizers"), "tiktoken": ("tiktoken",)}[library]
    return next((m for m in need if importlib.util.find_spec(m) is None), None)


def tokenizer_kind(path: str) -> tuple[str, str]:
    """(library, file) for a tokenizer path (see module docstring); raises TokenizerError."""
    if not path:
        raise TokenizerError("no tokenizer path given (data.tokenizer)")
    if os.path.isdir(path):
        for name, library in (("tokenizer.model", "sentencepiece"), ("tokenizer.json", "huggingface")):
            if os.path.isfile(os.path.join(path, name)):
                return library, os.path.join(path, name)
        raise TokenizerError(f"tokenizer path is a directory without tokenizer.model or tokenizer.json: {path}")
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer model not found: {path}")
    if path.endswith(".json"):
        try:
            with open(path) as f:
                blob = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"tokenizer file {path} is not readable JSON ({exc})") from None
        if isinstance(blob, dict) and "model" in blob:
            # Hugging Face's loader reads a folder's tokenizer.json (beside its config files)
            if os.path.basename(path) != "tokenizer.json":
                raise TokenizerError(f"{path} is a Hugging Face tokenizer file: name it tokenizer.json "
                                     "(its folder may hold tokenizer_config.json) or pass its folder")
            return "huggingface", path
        if isinstance(blob, list) and blob and isinstance(blob[0], dict) and "token_bytes" in blob[0]:
            return "tiktoken", path
        raise TokenizerError(f"{path} is neither a Hugging Face tokenizer.json nor a TikToken vocabulary "
                             "(a list of {rank, token_bytes, token_str})")
    return "sentencepiece", path


def load_tokenizer(path: str):
    """The tokenizer `path` names (module docstring); raises `TokenizerError` naming `path`."""
    library, file = tokenizer_kind(path)
    if library == "sentencepiece":
        return SentencePieceTokenizer(file)
    return LibraryTokenizer(file, library)
