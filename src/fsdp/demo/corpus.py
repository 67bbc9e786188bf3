"""The demo's training text: fables written by a small seeded grammar.

The text is generated, not copied, so it is free of any copyright (it is part of this
project, under its license). A fixed seed makes it the same everywhere; the file the
demo trains on, ``data/fables.txt``, is its output, regenerated with::

    uv run python -m fsdp.demo.corpus src/fsdp/demo/data/fables.txt

Each fable has a title, a few paragraphs of narration and dialogue drawn from word
lists and sentence templates, and a moral, so that a character-level model finds
plenty of structure to learn quickly: spelling, spacing, capitals, punctuation and
recurring phrases.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

__all__ = ["DEFAULT_SEED", "DEFAULT_SIZE", "generate"]

DEFAULT_SEED = 1729
DEFAULT_SIZE = 200_000  # characters

ANIMALS = (
    "fox", "heron", "badger", "crow", "hare", "tortoise", "wolf", "lark", "otter", "mole",
    "stag", "goose", "owl", "mouse", "bear", "swallow", "frog", "weasel", "ram", "wren",
)  # fmt: skip
PEOPLE = (
    "miller", "shepherd", "weaver", "fisherman", "potter", "king", "widow", "tinker",
    "farmer", "baker", "smith", "ferryman", "scholar", "goatherd", "queen", "beggar",
)  # fmt: skip
ADJECTIVES = (
    "old", "young", "proud", "clever", "foolish", "patient", "greedy", "humble", "quick",
    "lazy", "honest", "hungry", "gentle", "boastful", "wise", "timid", "cunning", "kind",
)  # fmt: skip
PLACES = (
    "by the river", "in the high meadow", "at the edge of the forest", "under the old oak",
    "on the hill above the village", "beside the mill pond", "in the valley of stones",
    "near the king's road", "among the reeds", "on the frozen lake", "in a field of barley",
    "at the bottom of a well", "behind the baker's house", "on the sea shore",
)  # fmt: skip
TIMES = (
    "One morning", "Late one autumn", "In the middle of winter", "On a hot summer day",
    "Long ago", "At the first light of spring", "One evening", "When the harvest was in",
    "After a week of rain", "On the night of the full moon",
)  # fmt: skip
THINGS = (
    "a piece of cheese", "a golden apple", "a sack of grain", "a silver bell",
    "a loaf of bread", "a basket of plums", "a warm coat", "a jar of honey", "a lost key",
    "a bright feather", "a bag of coins", "a map of the hills", "a clay pot", "a lantern",
)  # fmt: skip
WANTS = (
    "wanted it for itself", "thought it deserved it more", "had not eaten for three days",
    "hoped to trade it at the fair", "meant to give it to the king",
    "wished to show it to everyone", "believed it would bring good luck",
)  # fmt: skip
DEEDS = (
    "ran as fast as it could", "waited without a word", "hid behind a stone",
    "sang a sweet song", "told a long story", "dug a deep hole", "climbed the tallest tree",
    "crossed the river twice", "asked the owl for advice", "counted the stars all night",
    "laughed at the others", "worked from dawn until dusk", "fell fast asleep",
)  # fmt: skip
SAYINGS = (
    "Slow and steady wins the race", "A friend in need is a friend indeed",
    "Look before you leap", "Pride goes before a fall", "Little by little the bird builds its nest",
    "Do not count your eggs before they hatch", "Honesty is the best policy",
    "A kindness is never wasted", "Those who boast the loudest do the least",
    "Better a small fire that warms than a great one that burns",
    "The greedy lose what they have by grasping for more", "Every tool has its use",
)  # fmt: skip
REPLIES = (
    "I will not share it with you", "Come, let us go together", "Wait for me here",
    "You are braver than I thought", "That is not what I promised", "Let us ask the king",
    "I have never seen such a thing", "Give it back at once", "Tomorrow, perhaps",
    "Only a fool would believe that", "Thank you, my friend", "Follow me, and be quiet",
)  # fmt: skip
VERBS = ("said", "asked", "cried", "whispered", "answered", "shouted", "replied", "called")
ENDINGS = (
    "and from that day on they were friends",
    "and it never boasted again",
    "and went home with nothing at all",
    "and shared the prize with everyone in the {place}",
    "and the whole village laughed for a week",
    "and learned that patience is worth more than speed",
    "and the {other} was never seen {place} again",
)  # fmt: skip


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


class _Fable:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        pool = ANIMALS if rng.random() < 0.7 else PEOPLE
        self.hero, self.other = rng.sample(pool, 2)
        self.hero_adj, self.other_adj = rng.sample(ADJECTIVES, 2)
        self.place = rng.choice(PLACES)
        self.thing = rng.choice(THINGS)

    def pick(self, options: tuple[str, ...]) -> str:
        return self.rng.choice(options)

    def title(self) -> str:
        return f"THE {self.hero.upper()} AND THE {self.other.upper()}"

    def opening(self) -> str:
        time, place = self.pick(TIMES), self.place
        return (
            f"{time}, {_a(self.hero_adj)} {self.hero} found {self.thing} {place}. "
            f"{_a(self.other_adj).capitalize()} {self.other} saw it too, and {self.pick(WANTS)}."
        )

    def narration(self) -> str:
        who = self.rng.choice((self.hero, self.other))
        sentences = [
            f"The {who} {self.pick(DEEDS)}.",
            f"Then the {self.other} {self.pick(DEEDS)}, while the {self.hero} {self.pick(DEEDS)}.",
            f"Nobody {self.pick(PLACES)} had ever heard of {self.thing} like that.",
            f"So the {who} went {self.pick(PLACES)} and {self.pick(DEEDS)}.",
        ]
        return " ".join(self.rng.sample(sentences, self.rng.randint(2, 4)))

    def dialogue(self) -> str:
        speaker, _listener = self.rng.sample((self.hero, self.other), 2)
        verb = self.pick(VERBS)
        return f'"{self.pick(REPLIES)}," {verb} the {speaker}. "{self.pick(REPLIES)}."'

    def ending(self) -> str:
        end = self.pick(ENDINGS).format(place=self.place, other=self.other)
        return f"In the end the {self.hero} {self.pick(DEEDS)}, {end}."

    def text(self) -> str:
        paragraphs = [self.opening()]
        for _ in range(self.rng.randint(1, 3)):
            paragraphs.append(self.narration())
            paragraphs.append(self.dialogue())
        paragraphs.append(self.ending())
        moral = f"Moral: {self.pick(SAYINGS)}."
        return "\n\n".join([self.title(), *paragraphs, moral]) + "\n\n\n"


def generate(size: int = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> str:
    """Fables until the text is at least ``size`` characters long (whole fables)."""
    if size < 1:
        raise ValueError(f"size must be a positive number of characters; got {size}")
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < size:
        fable = _Fable(rng).text()
        parts.append(fable)
        total += len(fable)
    return "".join(parts)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m fsdp.demo.corpus OUTPUT_FILE")
    Path(sys.argv[1]).write_text(generate(), encoding="utf-8")
