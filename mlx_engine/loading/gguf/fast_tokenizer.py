"""The transformers tokenizer class a GGUF file's tokenizer is wrapped in.

Two of transformers' steps hold Python's GIL long enough to stall every other
thread's stream while a model loads (measured on SmolLM2's 49k-token
vocabulary, 2 CPU cores): ``PreTrainedTokenizerFast(tokenizer_object=...)``
deep-copies the backend it is given (150-330 ms), and ``get_vocab`` rebuilds
the whole vocabulary as a Python dict on every call (55-90 ms), which mlx-lm's
``TokenizerWrapper`` and the loader call several times; mlx-lm's BPE
detokenizer then asks for every id's token, one backend call each (50-110 ms).
The backend built by tokenizer.py belongs to this tokenizer alone, so it is
taken as it is; the vocabulary is built once and copied (a dict copy, ~1 ms)
until tokens are added, and ids are looked up in its inverse.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast


class GGUFTokenizerFast(PreTrainedTokenizerFast):
    """A ``PreTrainedTokenizerFast`` over ``backend`` (a ``tokenizers.Tokenizer``
    nothing else holds), without the copy, with its vocabulary cached."""

    def __init__(self, backend, **kwargs):
        if "tokenizer_object" in kwargs or "tokenizer_file" in kwargs:
            raise TypeError("GGUFTokenizerFast takes its backend as the first argument only")
        # transformers' __init__ uses an already-set backend instead of copying one it is given
        self._tokenizer = backend
        self._vocab: dict[str, int] | None = None
        self._tokens: list[str | None] | None = None
        super().__init__(**kwargs)

    def get_vocab(self) -> dict[str, int]:
        """Token to id, added tokens included (a fresh dict each call, as transformers')."""
        if self._vocab is None:
            self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        return dict(self._vocab)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """As transformers' (one id: its token; a list: their tokens, special
        ones left out when asked), from the cached vocabulary."""
        if isinstance(ids, int) or skip_special_tokens:
            return super().convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
        if self._tokens is None:
            vocab = self.get_vocab()
            self._tokens = [None] * (max(vocab.values(), default=-1) + 1)
            for token, index in vocab.items():
                self._tokens[index] = token
        tokens, known = self._tokens, len(self._tokens)
        out = []
        for index in ids:
            index = int(index)
            token = tokens[index] if 0 <= index < known else None
            out.append(token if token is not None else self._tokenizer.id_to_token(index))
        return out

    def _add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        self._vocab = self._tokens = None  # added tokens change the vocabulary
        return super()._add_tokens(new_tokens, special_tokens=special_tokens)
