"""The text the demo tokenizer is trained on, generated in code.

Contract: `training_corpus(n_lines)` returns the same `n_lines` strings on every machine and in
every process (a fixed-seed `random.Random`, embedded word lists, no files, no network). The
lines mix English prose, Python-like code, numbers, chat-like markup, camelCase identifiers,
invented place names (an open supply of distinct words, so a 4k-token BPE finds enough merges)
and non-ASCII text (accents, CJK, Cyrillic, Greek, emoji) so byte-level merges see multi-byte
characters. It is
not meant to be good data; it is meant to give a real, varied byte-level BPE vocabulary.
"""

import random

NOUNS = (
    "cache page state token model engine request router worker server client prompt answer "
    "question table river mountain garden window kitchen library teacher student village city "
    "market bridge forest ocean planet signal network kernel thread memory buffer record file "
    "folder number letter message history turn reply chart paper doctor engineer artist song "
    "story morning evening winter summer coffee bread apple orange pencil screen camera"
).split()
VERBS = (
    "read write compute store load send receive build test check find keep drop follow walk "
    "open close start stop move sort merge split count print parse render route serve cook "
    "paint learn teach carry draw watch climb swim explain remember forget measure"
).split()
ADJECTIVES = (
    "quick small large green quiet bright old new fast slow careful simple hidden shared "
    "empty full warm cold early late happy tired strange useful random local remote"
).split()
ADVERBS = "quickly slowly carefully often rarely always never quietly together again".split()
NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent".split()
FOREIGN = (
    "café naïve résumé façade jalapeño über Straße smörgåsbord 日本語 東京 中文 汉字 한국어 "
    "Привет мир Ελληνικά العربية हिन्दी ✓ → ∑ ≤ ≥ © € £ ¥ 🙂 🚀 👍🏽 🎉 🐍 ❤️"
).split()

SYLLABLES = (
    "ka lo ren tas vi mor el qua zin dor pel shi ath gru bex nol fi tor wen yas cor lum "
    "sta bri nex hol ver dax pim rau sel tho"
).split()

PROSE = (
    "The {adj} {noun} will {verb} the {noun2} {adv}.",
    "{name} asked whether the {noun} could {verb} {num} {noun2}s before {time}.",
    "Why does the {adj} {noun} of {place} {verb} so {adv}? Nobody knows.",
    "In {year}, {name} wrote a {adj} {noun} about {foreign} and {foreign2}.",
    "{name} travelled from {place} to {place2} to {verb} a {adj} {noun}.",
    "\"{name}, please {verb} the {noun},\" said {name2}. \"It's {adj}!\"",
    "We'll {verb} {num}% of the {noun}s; they're {adj}, aren't they?",
)
CODE = (
    "def {verb}_{noun}({noun2}, limit={num}):\n    return [{noun2} for _ in range(limit)]",
    "for i in range({num}):\n    {noun}.{verb}(i)  # {adj} {noun2}",
    "if {noun} is None:\n    raise ValueError(\"expected {noun2}, got {num}\")",
    "{{\"name\": \"{place}\", \"count\": {num}, \"tags\": [\"{adj}\", \"{foreign}\"]}}",
    "class {place}{Noun}:\n    def {verb}(self) -> int:\n        return {num}",
    "const {verb}{Noun} = ({noun2}) => {noun2}.map((x) => x * {num});",
)
MARKUP = (
    "## {place} {verb}\n- {adj} {noun}\n- {num} {noun2}s\n",
    "User: can you {verb} my {noun}?\nAssistant: Sure, here is a {adj} {noun} {foreign}.",
    "{year}-{month:02d}-{day:02d} {hour:02d}:{minute:02d} {verb}{Noun}{Adj} ${num}.{cents:02d}",
    "{num} + {num2} = {total}; {num} * 3 = {triple}; ID {verb}{Noun}{Noun2}{Adj}",
)


def _place_names(rng: random.Random, n: int) -> list[str]:
    """Invented place names: an open-ended supply of distinct words for the BPE to merge."""
    return [
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()
        for _ in range(n)
    ]


def _fill(template: str, rng: random.Random, places: list[str]) -> str:
    # Zipf-like: early place names recur often, late ones rarely.
    place, place2 = (places[int(len(places) * rng.random() ** 2)] for _ in range(2))
    noun, noun2 = rng.choice(NOUNS), rng.choice(NOUNS)
    num, num2 = rng.randint(0, 9999), rng.randint(0, 999)
    return template.format(
        noun=noun, noun2=noun2, Noun=noun.capitalize(), Noun2=noun2.capitalize(),
        verb=rng.choice(VERBS), adv=rng.choice(ADVERBS),
        adj=rng.choice(ADJECTIVES), Adj=rng.choice(ADJECTIVES).capitalize(),
        name=rng.choice(NAMES), name2=rng.choice(NAMES), place=place, place2=place2,
        foreign=rng.choice(FOREIGN), foreign2=rng.choice(FOREIGN),
        num=num, num2=num2, total=num + num2, triple=num * 3,
        year=rng.randint(1900, 2030), month=rng.randint(1, 12), day=rng.randint(1, 28),
        hour=rng.randint(0, 23), minute=rng.randint(0, 59), cents=rng.randint(0, 99),
        time=rng.choice(("noon", "dawn", "dusk")),
    )


def training_corpus(n_lines: int) -> list[str]:
    """`n_lines` deterministic training lines (prose, code, markup, non-ASCII)."""
    rng = random.Random(0)
    places = _place_names(rng, max(50, n_lines // 4))
    templates = PROSE + CODE + MARKUP
    return [_fill(templates[i % len(templates)], rng, places) for i in range(n_lines)]
