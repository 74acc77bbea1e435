"""Word lists the generators draw from (names, objects, identifier parts).

Why lists of plain, common words: the tiny models see each word thousands of times, so the
words become cheap, predictable tokens, and the hard positions of a response are the numbers
(arithmetic) and copied identifiers (code), which is where decoding order matters.
"""

from __future__ import annotations

# fmt: off
#: (name, subject pronoun, possessive pronoun)
PEOPLE: tuple[tuple[str, str, str], ...] = tuple(
    [(n, "he", "his") for n in (
        "Tom", "Sam", "Ben", "Leo", "Max", "Jack", "Ryan", "Omar", "Carlos", "Ivan", "Raj", "Ken",
        "Luke", "Noah", "Eli", "Paul", "Hugo", "Dan", "Finn", "Adam",
    )]
    + [(n, "she", "her") for n in (
        "Ann", "Mia", "Zoe", "Lily", "Emma", "Nora", "Ava", "Sara", "Maria", "Priya", "Yuki", "Jane",
        "Rosa", "Kate", "Ella", "Grace", "Ruth", "Lucy", "Amy", "Ines",
    )]
)

#: countable things (plural), for "has 5 apples"
THINGS: tuple[str, ...] = (
    "apples", "pens", "stickers", "marbles", "cookies", "books", "cards", "shells", "coins", "stamps",
    "balloons", "candies", "toys", "flowers", "eggs", "pencils", "cups", "rocks", "beads", "shirts",
    "plates", "buttons", "oranges", "crayons", "blocks", "kites", "ribbons", "leaves", "cars", "nuts",
)

#: containers, for "3 boxes with 4 cookies in each"
CONTAINERS: tuple[str, ...] = ("boxes", "bags", "jars", "baskets", "packs", "bowls", "trays", "cases")

#: things sold at a price, for "A pen costs 3 dollars"
PRICED: tuple[tuple[str, str], ...] = (
    ("pen", "pens"), ("cup", "cups"), ("book", "books"), ("ticket", "tickets"), ("toy", "toys"),
    ("cake", "cakes"), ("ball", "balls"), ("hat", "hats"), ("card", "cards"), ("lamp", "lamps"),
    ("plant", "plants"), ("kite", "kites"), ("sock", "socks"), ("map", "maps"), ("bowl", "bowls"),
)

#: first halves of function names ("tally" in ``tally_scores``)
NAME_VERBS: tuple[str, ...] = (
    "add", "bump", "scale", "shift", "count", "tally", "sum", "total", "find", "get", "pick", "make",
    "build", "check", "test", "flip", "join", "trim", "grow", "mix", "fold", "keep", "take", "give",
    "lift", "raise", "boost", "spin", "turn", "load", "map", "sift", "sort", "mark", "rank", "tag",
    "pack", "push", "pull", "read", "send", "calc", "eval", "measure", "weigh", "score", "track",
    "apply", "merge", "clip",
)

#: second halves of function names ("scores" in ``tally_scores``)
NAME_NOUNS: tuple[str, ...] = (
    "score", "price", "value", "level", "items", "marks", "coins", "points", "total", "amount",
    "count", "number", "data", "list", "word", "text", "name", "label", "size", "step", "rate",
    "speed", "depth", "width", "height", "weight", "age", "cost", "bonus", "limit", "stock", "load",
    "votes", "goals", "pages", "tiles", "cells", "nodes", "keys", "bits", "days", "hours", "miles",
    "seeds", "rows", "grid", "batch", "queue", "stack", "pair",
)

#: words for the string tasks (lower case, short, common)
WORDS: tuple[str, ...] = (
    "cat", "dog", "sun", "red", "blue", "tree", "fish", "bird", "moon", "star", "book", "cake",
    "lamp", "rain", "snow", "ship", "road", "hill", "lake", "rose", "milk", "corn", "gold", "iron",
)
# fmt: on
