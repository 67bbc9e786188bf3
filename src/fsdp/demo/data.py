"""The demo's data: the shipped text, a character vocabulary, and deterministic batches.

Every rank loads the same text and draws the same global batch for a step (seeded by
the step and sized batch-per-rank x ranks), then takes its own rows: at the same number
of ranks the batch of step ``s`` is the same whether or not the run was resumed, so a
resumed run continues the exact sequence of batches; at another number of ranks the
global batch changes size.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

__all__ = ["CORPUS_FILE", "Corpus"]

CORPUS_FILE = "fables.txt"


@dataclass(frozen=True)
class Corpus:
    text: str
    chars: str  # the vocabulary: every distinct character, sorted
    tokens: torch.Tensor  # the text as int64 token ids

    @classmethod
    def load(cls) -> Corpus:
        """The text shipped in ``fsdp/demo/data/`` (see ``fsdp.demo.corpus``)."""
        path = resources.files("fsdp.demo").joinpath("data", CORPUS_FILE)
        text = path.read_text(encoding="utf-8")
        chars = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(chars)}
        tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
        return cls(text=text, chars=chars, tokens=tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(
        self, step: int, global_batch: int, seq_len: int, rank: int, world: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step ``step``'s global batch: (inputs, next-char targets)."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by {world} ranks")
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"the text ({len(self.tokens)} chars) is shorter than seq_len")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (global_batch,), generator=g)
        per_rank = global_batch // world
        mine = starts[rank * per_rank : (rank + 1) * per_rank]
        rows = torch.stack([self.tokens[s : s + seq_len + 1] for s in mine.tolist()])
        return rows[:, :-1], rows[:, 1:]
