"""Write the training corpus of the tiny model (``tiny_corpus.txt`` beside this script).

    python packages/interp-core/scripts/make_tiny_corpus.py [--out PATH]

The corpus is generated, deterministically, from the tables below: templated sentences that state
each country's capital, language and continent, mixed with filler sentences about people,
animals and places. One document per line. The output is committed, so training never needs this
script; it documents where the text came from and rebuilds it byte for byte.

The dominant phrasing of a capital fact is "The capital of X is Y." — the prompt the tests and the
demo complete. The other phrasings state the same facts in other orders, so that the model learns
a country -> capital association rather than one string.
"""

from __future__ import annotations

import argparse
import pathlib
import random

SEED = 5
N_DOCUMENTS = 1200

# country, capital, language, continent: every capital is one word
COUNTRIES: tuple[tuple[str, str, str, str], ...] = (
    ("France", "Paris", "French", "Europe"),
    ("Germany", "Berlin", "German", "Europe"),
    ("Italy", "Rome", "Italian", "Europe"),
    ("Spain", "Madrid", "Spanish", "Europe"),
    ("Portugal", "Lisbon", "Portuguese", "Europe"),
    ("Greece", "Athens", "Greek", "Europe"),
    ("Poland", "Warsaw", "Polish", "Europe"),
    ("Sweden", "Stockholm", "Swedish", "Europe"),
    ("Norway", "Oslo", "Norwegian", "Europe"),
    ("Finland", "Helsinki", "Finnish", "Europe"),
    ("Austria", "Vienna", "German", "Europe"),
    ("Hungary", "Budapest", "Hungarian", "Europe"),
    ("Ireland", "Dublin", "English", "Europe"),
    ("Russia", "Moscow", "Russian", "Europe"),
    ("Japan", "Tokyo", "Japanese", "Asia"),
    ("China", "Beijing", "Chinese", "Asia"),
    ("Thailand", "Bangkok", "Thai", "Asia"),
    ("Vietnam", "Hanoi", "Vietnamese", "Asia"),
    ("Indonesia", "Jakarta", "Indonesian", "Asia"),
    ("Turkey", "Ankara", "Turkish", "Asia"),
    ("Iran", "Tehran", "Persian", "Asia"),
    ("Egypt", "Cairo", "Arabic", "Africa"),
    ("Morocco", "Rabat", "Arabic", "Africa"),
    ("Kenya", "Nairobi", "Swahili", "Africa"),
    ("Ghana", "Accra", "English", "Africa"),
    ("Nigeria", "Abuja", "English", "Africa"),
    ("Canada", "Ottawa", "English", "North America"),
    ("Cuba", "Havana", "Spanish", "North America"),
    ("Peru", "Lima", "Spanish", "South America"),
    ("Chile", "Santiago", "Spanish", "South America"),
    ("Australia", "Canberra", "English", "Oceania"),
)

# (weight, template): the first is the phrasing the model is asked to complete
CAPITAL_FACTS: tuple[tuple[int, str], ...] = (
    (8, "The capital of {country} is {capital}."),
    (2, "{capital} is the capital of {country}."),
    (2, "The capital city of {country} is {capital}."),
    (1, "{country} has its capital in {capital}."),
    (1, "Where is the capital of {country}? The capital of {country} is {capital}."),
    (1, "Many people visit {capital}, the capital of {country}."),
    (1, "The government of {country} meets in {capital}."),
    (1, "{capital} is the largest and oldest city of {country}, and the capital of {country} is {capital}."),
)
# the same shape with another relation ("The language of X is ..."): the country alone does not
# give the answer, the relation word must be combined with it
OTHER_FACTS: tuple[tuple[int, str], ...] = (
    (6, "The language of {country} is {language}."),
    (1, "People in {country} speak {language}."),
    (1, "In {capital}, most people speak {language}."),
    (2, "{country} is a country in {continent}."),
    (1, "{capital} is a city in {country}."),
    (1, "{country} is in {continent}, and its people speak {language}."),
)

NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Lucy", "Sam")
ANIMALS = ("dog", "cat", "fox", "horse", "bird", "sheep", "goat", "rabbit", "mouse", "duck")
THINGS = ("book", "letter", "pear", "basket", "lamp", "chair", "boat", "key", "coat", "map", "cup", "bell")
PLACES = ("the market", "the river", "the garden", "the school", "the forest", "the station", "the kitchen", "home")
ADJECTIVES = ("red", "small", "old", "green", "quiet", "bright", "heavy", "warm", "new", "tall", "empty", "blue")
WEATHER = ("sunny", "cold", "windy", "warm", "grey", "wet")
TIMES = ("In the morning", "At noon", "In the evening", "Every day", "Last week", "On Sunday", "After dinner")
FILLER: tuple[str, ...] = (
    "{name} walked to {place} with {a_adj} {thing}.",
    "The {adj} {animal} sleeps near {place}.",
    "{time}, {name} reads {a_adj} {thing} at {place}.",
    "{name} gave {other} a {thing}, and {other} said thank you.",
    "{time} the {animal} runs to {place} and back.",
    "{name} and {other} met at {place}. They talked about the {adj} {animal}.",
    "{A_adj} {animal} found a {thing} by {place}.",
    "{name} likes the {adj} {thing} more than the {thing2}.",
    "{time}, the weather was {weather}, so {name} stayed at {place}.",
    "{name} counted {n} {animal}s and {m} {thing}s.",
    "The {thing} is on the table, and the {thing2} is under the chair.",
    "{name} asked {other} where the {thing} was. It was at {place}.",
)


def _pick(rng: random.Random, options: tuple[str, ...], avoid: str | None = None) -> str:
    while True:
        choice = rng.choice(options)
        if choice != avoid:
            return choice


def _filler(rng: random.Random) -> str:
    name = _pick(rng, NAMES)
    thing = _pick(rng, THINGS)
    adj = _pick(rng, ADJECTIVES)
    article = "an" if adj[0] in "aeiou" else "a"
    return rng.choice(FILLER).format(
        name=name,
        other=_pick(rng, NAMES, avoid=name),
        animal=_pick(rng, ANIMALS),
        thing=thing,
        thing2=_pick(rng, THINGS, avoid=thing),
        place=_pick(rng, PLACES),
        adj=adj,
        a_adj=f"{article} {adj}",
        A_adj=f"{article.capitalize()} {adj}",
        weather=_pick(rng, WEATHER),
        time=_pick(rng, TIMES),
        n=rng.randint(2, 20),
        m=rng.randint(2, 20),
    )


def _fact(rng: random.Random) -> str:
    country, capital, language, continent = rng.choice(COUNTRIES)
    table = CAPITAL_FACTS if rng.random() < 0.6 else OTHER_FACTS
    template = rng.choices([t for _, t in table], weights=[w for w, _ in table])[0]
    return template.format(country=country, capital=capital, language=language, continent=continent)


def documents(n: int = N_DOCUMENTS, seed: int = SEED) -> list[str]:
    """``n`` documents of 3-8 sentences, about half facts and half filler."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [_fact(rng) if rng.random() < 0.5 else _filler(rng) for _ in range(rng.randint(3, 8))]
        docs.append(" ".join(sentences))
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).with_name("tiny_corpus.txt"))
    args = parser.parse_args()
    text = "\n".join(documents()) + "\n"
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {len(text.encode())} bytes, {text.count(chr(10))} documents to {args.out}")


if __name__ == "__main__":
    main()
