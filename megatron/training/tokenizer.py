"""SentencePiece tokenizer in the shape megatron-core's datasets expect.

`GPTDataset` and `MegatronDataset` read only a few attributes off `config.tokenizer`:
`vocab_size` (to pick the token dtype), `eod` (document boundaries for position ids and
masks), `pad` (masked out of the loss) and, for collision checks, `eos`. They also hash
`unique_identifiers` into the dataset cache key, so two different tokenizer files never share a
cached index. This class provides exactly that, plus `tokenize`/`detokenize` for the data
scripts, on top of a model trained by `scripts/train_tokenizer.py` (ids: pad 0, unk 1, bos 2,
eos 3; the end-of-document token `eod` is the `eos` id).

`load_tokenizer(path)` is the one entry point; a missing or unreadable model raises
`TokenizerError` with one message naming the file.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Iterable, List

import warnings

# megatron.core's package import warns four times that TE/apex are absent; they are optional
# accelerators (see README), so the data tools keep that line out of their output.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron.core.tokenizers import MegatronTokenizerBase  # noqa: E402


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or lacks a required special token."""


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


def load_tokenizer(path: str) -> SentencePieceTokenizer:
    """Load a SentencePiece model; raises `TokenizerError` naming `path` if it is unusable."""
    if not path:
        raise TokenizerError("no tokenizer model path given")
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(candidate):
            raise TokenizerError(f"tokenizer path is a directory without tokenizer.model: {path}")
        path = candidate
    return SentencePieceTokenizer(path)
