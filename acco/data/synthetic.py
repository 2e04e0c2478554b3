"""A deterministic, offline corpus of short children's stories.

It is the embedded default dataset (`data=synthetic`): it needs no download, and it has enough
structure for a tiny transformer to learn something measurable. The stories come from a small
probabilistic grammar:

- fixed phrases ("Once upon a time", "From that day on", "The end.") that a model can memorise;
- a cast chosen per story (a hero and a friend with names, kinds and pronouns) whose names come
  back in every later sentence, so predicting them needs the context, not just word counts;
- one object per story that is mentioned again and again ("the red kite ... the kite");
- a plot with a fixed order (opening, setting, event, meeting, dialogue, resolution, ending).

A model that only knows word frequencies sits at the unigram entropy; one that learns the phrases
and copies names from context goes well below it. `unigram_entropy` gives that reference value.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence

# (name, subject pronoun, possessive pronoun, object pronoun); "{him}self" makes the reflexive
_NAMES = [
    ("Lily", "she", "her", "her"), ("Tom", "he", "his", "him"), ("Mia", "she", "her", "her"),
    ("Ben", "he", "his", "him"), ("Sue", "she", "her", "her"), ("Max", "he", "his", "him"),
    ("Anna", "she", "her", "her"), ("Sam", "he", "his", "him"), ("Zoe", "she", "her", "her"),
    ("Leo", "he", "his", "him"), ("Ella", "she", "her", "her"), ("Jack", "he", "his", "him"),
    ("Rosa", "she", "her", "her"), ("Finn", "he", "his", "him"), ("Nina", "she", "her", "her"),
    ("Theo", "he", "his", "him"), ("Ivy", "she", "her", "her"), ("Otto", "he", "his", "him"),
    ("Lucy", "she", "her", "her"), ("Pip", "he", "his", "him"), ("Kate", "she", "her", "her"),
    ("Bob", "he", "his", "him"), ("Emma", "she", "her", "her"), ("Tim", "he", "his", "him"),
]
_KINDS_HERO = ["girl", "boy", "cat", "dog", "bunny", "bear", "bird", "mouse", "fox", "duck"]
_KINDS_FRIEND = ["frog", "owl", "puppy", "kitten", "squirrel", "turtle", "lamb", "pig", "horse"]
_HERO_ADJ = ["little", "happy", "brave", "kind", "curious", "shy", "funny", "small", "smart"]
_PLACES = [
    "a small house near the woods", "a big city", "a farm by the river", "a tall tree",
    "a quiet town", "a cozy hole under a hill", "a blue boat on the lake", "a busy street",
]
_FAMILY = ["mom", "dad", "grandma", "grandpa", "sister", "brother"]
_ACTIVITIES = [
    "play in the park", "run in the grass", "sing songs", "draw pictures", "look at the stars",
    "jump in puddles", "read books", "build towers with blocks", "swim in the pond",
]
_OBJ_ADJ = ["red", "shiny", "old", "big", "soft", "tiny", "pretty", "broken", "yellow", "green"]
_OBJECTS = ["ball", "kite", "box", "hat", "car", "key", "cup", "drum", "book", "shell", "rock"]
_WHERE = ["under a bush", "in the garden", "on the beach", "near the door", "in the sand",
          "behind a tree", "on the road", "in a puddle"]
_EVENTS = ["found", "saw", "lost"]
_FEELINGS_GOOD = ["happy", "excited", "proud", "glad"]
_FEELINGS_BAD = ["sad", "scared", "worried", "upset"]


def _story(rng: random.Random) -> str:
    """One story. Each `rng.choice` is a branch of the grammar; names and the object repeat."""
    hero, he, his, him = rng.choice(_NAMES)
    friend = rng.choice([n for n in _NAMES if n[0] != hero])[0]
    kind = rng.choice(_KINDS_HERO)
    friend_kind = rng.choice(_KINDS_FRIEND)
    adj = rng.choice(_HERO_ADJ)
    obj_adj, obj = rng.choice(_OBJ_ADJ), rng.choice(_OBJECTS)
    event = rng.choice(_EVENTS)
    good, bad = rng.choice(_FEELINGS_GOOD), rng.choice(_FEELINGS_BAD)
    He = he.capitalize()

    s = []
    s.append(rng.choice([
        f"Once upon a time, there was a {adj} {kind} named {hero}.",
        f"Once upon a time, there was a {adj} {kind} called {hero}.",
        f"There once was a {adj} {kind} named {hero}.",
    ]))
    s.append(f"{hero} lived in {rng.choice(_PLACES)} with {his} {rng.choice(_FAMILY)}.")
    if rng.random() < 0.7:
        s.append(f"{hero} loved to {rng.choice(_ACTIVITIES)} every day.")
    where = rng.choice(_WHERE)
    if event == "lost":
        s.append(f"One day, {hero} lost {his} {obj_adj} {obj} {where}.")
        s.append(f"{He} looked and looked, but {he} could not find the {obj}. {hero} felt {bad}.")
        s.append(f"Then {hero} met a {friend_kind} named {friend}.")
        s.append(rng.choice([
            f'{friend} said, "Do not be {bad}, {hero}. I will help you find your {obj}."',
            f'"Why are you {bad}, {hero}?" asked {friend}. "I lost my {obj}," said {hero}.',
        ]))
        s.append(f"{hero} and {friend} looked {where} together. "
                 f"At last, {friend} found the {obj_adj} {obj}!")
        s.append(f'"Thank you, {friend}!" said {hero}. {He} was very {good}.')
    else:
        s.append(f"One day, {hero} {event} a {obj_adj} {obj} {where}.")
        s.append(f"{He} wanted to keep the {obj} all for {him}self.")
        s.append(f"Then {hero} met a {friend_kind} named {friend}.")
        s.append(rng.choice([
            f'{friend} said, "What a {obj_adj} {obj}! Can I play with it, {hero}?"',
            f'"Hello, {hero}," said {friend}. "May I see your {obj}?"',
        ]))
        if rng.random() < 0.5:
            s.append(f"{hero} felt {bad}, but then {he} shared the {obj} with {friend}.")
            s.append(f"{hero} and {friend} played with the {obj} all day. They were very {good}.")
        else:
            s.append(f'{hero} said, "No, it is my {obj}!" {friend} felt {bad} and went away.')
            s.append(f"Soon {hero} was {bad} too. {He} ran to {friend} and said sorry.")
            s.append(f"{hero} gave the {obj} to {friend}, and {friend} was {good}.")
    s.append(rng.choice([
        f"From that day on, {hero} and {friend} were best friends.",
        f"{hero} learned that sharing makes everyone {good}.",
        "They lived happily ever after.",
        "The end.",
    ]))
    return " ".join(s)


def synthetic_corpus(n_docs: int, seed: int = 0) -> list[str]:
    """`n_docs` stories, a pure function of (`n_docs`, `seed`).

    One RNG drives the stories in order, so a larger corpus extends a smaller one with the same
    seed (the first k stories are the same), which keeps train/eval carve-outs stable.
    """
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    rng = random.Random(seed)
    return [_story(rng) for _ in range(n_docs)]


def unigram_entropy(token_lists: Iterable[Sequence]) -> float:
    """Entropy in nats of the token frequency distribution over all lists.

    This is the loss of the best model that ignores context: a language model that learned
    anything from the order of tokens must get below it.
    """
    counts: Counter = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("unigram_entropy needs at least one token")
    return -sum(c / total * math.log(c / total) for c in counts.values())
