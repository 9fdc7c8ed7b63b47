"""A deterministic, learnable word-level text corpus for the GPT example and tests.

Sentences come from a small hand-written grammar in which every noun prefers a few adjectives
and verbs and every preposition a few places, so a language model can do much better than the
unigram entropy: the loss of a small GPT visibly drops within tens of steps. The text is
generated, not downloaded, so it is identical on every machine and needs no network.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

__all__ = ["VOCAB", "corpus_text", "corpus_tokens", "decode", "lm_batches"]

_DETS = ("the", "a", "every", "one")
_ADJS = (
    "old", "young", "quiet", "loud", "small", "large", "red", "green", "blue", "grey",
    "bright", "dark", "quick", "slow", "brave", "shy", "warm", "cold", "wise", "tired",
)  # fmt: skip
_NOUNS = (
    "fox", "dog", "cat", "bird", "horse", "river", "tree", "stone", "wind", "ship", "child",
    "farmer", "king", "queen", "wolf", "bear", "owl", "fish", "miller", "baker", "smith",
    "lamp", "bell", "road",
)  # fmt: skip
_VERBS = (
    "sees", "hears", "follows", "finds", "carries", "watches", "greets", "crosses", "calls",
    "paints", "guards", "feeds", "meets", "leaves", "remembers", "builds", "warns", "answers",
    "chases", "helps",
)  # fmt: skip
_ADVS = (
    "slowly", "quickly", "again", "today", "gladly", "softly", "at dawn", "at night",
    "in silence", "once more",
)  # fmt: skip
_PREPS = ("to", "from", "near", "under", "over", "beside", "behind", "past")
_PLACES = (
    "hill", "town", "mill", "forest", "bridge", "harbour", "market", "valley", "castle",
    "meadow", "well", "gate",
)  # fmt: skip
_SPECIAL = ("<eos>", ".", ",", "and", "when", "then")


def _build_vocab() -> tuple[str, ...]:
    words: list[str] = list(_SPECIAL)
    for group in (_DETS, _ADJS, _NOUNS, _VERBS, _ADVS, _PREPS, _PLACES):
        for phrase in group:
            words.extend(w for w in phrase.split() if w not in words)
    return tuple(words)


VOCAB: tuple[str, ...] = _build_vocab()
"""Token id -> word. Every corpus token id is < len(VOCAB)."""

_IDS = {w: i for i, w in enumerate(VOCAB)}


class _Grammar:
    """Draws sentences; `rng` is a private `random.Random`, never the global one."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def _noun_phrase(self, with_adj: bool) -> tuple[list[str], int]:
        n = self.rng.randrange(len(_NOUNS))
        words = [self.rng.choice(_DETS)]
        if with_adj:  # each noun takes one of three "own" adjectives
            words.append(_ADJS[(n * 3 + self.rng.randrange(3)) % len(_ADJS)])
        return [*words, _NOUNS[n]], n

    def _verb(self, noun: int) -> str:  # each noun takes one of two "own" verbs
        return _VERBS[(noun * 7 + self.rng.randrange(2)) % len(_VERBS)]

    def _place(self) -> list[str]:
        p = self.rng.randrange(len(_PREPS))
        place = _PLACES[(p * 5 + self.rng.randrange(2)) % len(_PLACES)]
        return [_PREPS[p], "the", place]

    def sentence(self) -> list[str]:
        kind = self.rng.randrange(4)
        subj, n = self._noun_phrase(with_adj=kind != 1)
        if kind == 0:
            obj, _ = self._noun_phrase(with_adj=True)
            return [*subj, self._verb(n), *obj, "."]
        if kind == 1:
            return [*subj, self._verb(n), "the", _NOUNS[(n + 1) % len(_NOUNS)], *self._place(), "."]
        if kind == 2:
            other, m = self._noun_phrase(with_adj=False)
            return [*subj, "and", *other, self._verb(m), self.rng.choice(_ADVS), "."]
        obj, _ = self._noun_phrase(with_adj=False)
        return ["when", *subj, self._verb(n), *obj, ",", "then", *self._place(), "."]


def _words(n_words: int, seed: int) -> list[str]:
    # Python's Mersenne Twister with an explicit seed gives the same stream on every platform
    # and is far cheaper per draw than a torch call per word.
    grammar = _Grammar(random.Random(seed))
    words: list[str] = []
    while len(words) < n_words:
        for _ in range(grammar.rng.randrange(3, 7)):  # a paragraph, then <eos>
            for phrase in grammar.sentence():
                words.extend(phrase.split())
        words.append("<eos>")
    return words[:n_words]


def corpus_tokens(n_tokens: int, vocab_size: int, seed: int) -> Tensor:
    """`n_tokens` word-level token ids (int64), deterministic in `seed`.

    Ids are indices into `VOCAB`; `vocab_size` is the model's vocabulary, which must hold them
    (ids >= len(VOCAB) simply never occur).
    """
    if n_tokens < 1:
        raise ValueError(f"megabuf.testing: n_tokens must be >= 1, got {n_tokens}")
    if vocab_size < len(VOCAB):
        raise ValueError(
            f"megabuf.testing: vocab_size={vocab_size} is smaller than the corpus vocabulary "
            f"({len(VOCAB)} words); use a model with vocab_size >= {len(VOCAB)}"
        )
    return torch.tensor([_IDS[w] for w in _words(n_tokens, seed)], dtype=torch.long)


def corpus_text(n_words: int, seed: int) -> str:
    """The same text as `corpus_tokens` as a readable string (for printing a sample)."""
    return decode(corpus_tokens(n_words, len(VOCAB), seed))


def decode(tokens: Tensor) -> str:
    """Token ids -> text; ids outside `VOCAB` show as `<id>`."""
    out = [VOCAB[i] if 0 <= i < len(VOCAB) else f"<{i}>" for i in tokens.tolist()]
    return " ".join(out).replace(" .", ".").replace(" ,", ",")


def lm_batches(tokens: Tensor, batch_size: int, seq_len: int, step: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each [batch_size, seq_len], for training step `step`.

    Row i of step s is window w = (s * batch_size + i) mod n_windows, where window w holds
    inputs tokens[w*T : w*T + T] and targets shifted by one (T = seq_len). Consecutive windows
    tile the corpus, so every step is a pure function of (tokens, batch_size, seq_len, step) and
    a data-parallel rank can take any contiguous slice of the rows.
    """
    if tokens.dim() != 1:
        raise ValueError(f"megabuf.testing: tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if batch_size < 1 or seq_len < 1 or step < 0:
        raise ValueError(
            f"megabuf.testing: need batch_size >= 1, seq_len >= 1, step >= 0; got "
            f"{batch_size=}, {seq_len=}, {step=}"
        )
    n_windows = (tokens.numel() - 1) // seq_len
    if n_windows < 1:
        raise ValueError(
            f"megabuf.testing: corpus of {tokens.numel()} tokens is too short for seq_len {seq_len}"
        )
    idx = (torch.arange(batch_size) + step * batch_size) % n_windows
    offsets = idx[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    windows = tokens[offsets]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
