"""The generated product catalogue of the ``webshop`` env and its BM25 search engine.

A fixed table of product types (category, attribute pool, option kinds with their values, price
range) and a seeded generator make a few thousand products: each gets a made-up brand, 2-4
attributes of its type, a few values of each option kind and a price. The catalogue and its
BM25 index (``rank_bm25``) are built once per process, on first use, and shared by every env
instance; query results are cached, so a repeated search costs a dictionary lookup.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import NamedTuple

import numpy as np

SEED = 0
SIZE = 3000
MAX_RESULTS = 50  # results a search returns (WebShop's default too)

# type -> (category, attributes, {option kind: values}, (min, max) price in dollars)
TYPES: dict[str, tuple[str, tuple[str, ...], dict[str, tuple[str, ...]], tuple[int, int]]] = {
    "shampoo": ("beauty", ("sulfate free", "paraben free", "natural ingredients", "for dry hair",
                           "long lasting", "cruelty free", "tea tree", "color safe"),
                {"size": ("8 fl oz", "16 fl oz", "32 fl oz"),
                 "scent": ("lavender", "coconut", "citrus", "unscented")}, (6, 35)),
    "lipstick": ("beauty", ("long lasting", "waterproof", "cruelty free", "matte finish",
                            "moisturizing", "vegan", "highly pigmented", "travel size"),
                 {"color": ("ruby red", "nude", "berry", "coral", "mauve")}, (5, 30)),
    "face moisturizer": ("beauty", ("fragrance free", "sensitive skin", "hyaluronic acid", "spf 30",
                                    "oil free", "anti aging", "dermatologist tested", "non comedogenic"),
                         {"size": ("1.7 oz", "2.5 oz", "4 oz")}, (10, 60)),
    "electric toothbrush": ("beauty", ("rechargeable", "waterproof", "travel case", "smart timer",
                                       "sensitive mode", "long battery life", "whitening",
                                       "pressure sensor"),
                            {"color": ("white", "black", "pink", "blue"), "pack": ("1 pack", "2 pack")},
                            (20, 120)),
    "t-shirt": ("clothing", ("machine washable", "short sleeve", "cotton", "slim fit",
                             "moisture wicking", "relaxed fit", "tagless", "v neck"),
                {"size": ("x-small", "small", "medium", "large", "x-large"),
                 "color": ("black", "white", "navy", "heather grey", "olive")}, (8, 40)),
    "jeans": ("clothing", ("high waist", "stretch", "straight leg", "slim fit", "machine washable",
                           "button fly", "distressed", "bootcut"),
              {"size": ("waist 28", "waist 30", "waist 32", "waist 34", "waist 36"),
               "color": ("dark wash", "light wash", "black", "stone")}, (20, 90)),
    "running shoes": ("clothing", ("non slip", "lightweight", "breathable mesh", "memory foam",
                                   "arch support", "wide toe box", "rubber sole", "water resistant"),
                      {"size": ("us 7", "us 8", "us 9", "us 10", "us 11"),
                       "color": ("black", "white", "grey", "blue", "red")}, (30, 140)),
    "hoodie": ("clothing", ("fleece lined", "machine washable", "zip up", "kangaroo pocket",
                            "pullover", "oversized", "cotton blend", "drawstring hood"),
               {"size": ("small", "medium", "large", "x-large", "xx-large"),
                "color": ("black", "charcoal", "burgundy", "forest green", "navy")}, (20, 70)),
    "wireless earbuds": ("electronics", ("noise cancelling", "bluetooth 5.3", "water resistant",
                                         "long battery life", "wireless charging case", "touch control",
                                         "built-in microphone", "low latency"),
                         {"color": ("black", "white", "blue")}, (15, 200)),
    "phone charger": ("electronics", ("fast charging", "usb c", "compact", "foldable plug", "multi port",
                                      "overheat protection", "gan technology", "travel friendly"),
                      {"power": ("20w", "30w", "65w"), "color": ("white", "black")}, (8, 50)),
    "bluetooth speaker": ("electronics", ("waterproof", "portable", "24 hour battery", "deep bass",
                                          "built-in microphone", "stereo pairing", "shockproof",
                                          "usb c charging"),
                          {"color": ("black", "blue", "red", "camo")}, (20, 150)),
    "laptop stand": ("electronics", ("adjustable height", "aluminum", "foldable", "ventilated",
                                     "non slip", "portable", "ergonomic", "heavy duty"),
                     {"color": ("silver", "space grey", "black")}, (15, 70)),
    "coffee maker": ("home", ("programmable", "auto shut off", "stainless steel", "thermal carafe",
                              "single serve", "dishwasher safe", "reusable filter", "keep warm"),
                     {"capacity": ("4 cup", "8 cup", "12 cup"), "color": ("black", "silver", "red")},
                     (25, 200)),
    "bed sheets": ("home", ("deep pocket", "wrinkle free", "breathable", "cooling", "organic cotton",
                            "machine washable", "hypoallergenic", "400 thread count"),
                   {"size": ("twin", "full", "queen", "king"),
                    "color": ("white", "ivory", "grey", "sage", "navy")}, (20, 120)),
    "desk lamp": ("home", ("dimmable", "usb charging port", "touch control", "eye caring",
                           "adjustable arm", "energy efficient", "memory function", "clamp mount"),
                  {"color": ("black", "white", "silver")}, (15, 80)),
    "pillow covers": ("home", ("machine washable", "hidden zipper", "velvet", "set of 2",
                               "double sided", "linen", "fade resistant", "decorative"),
                      {"size": ("18x18 inch", "20x20 inch", "22x22 inch"),
                       "color": ("mustard", "teal", "blush", "cream", "grey")}, (8, 40)),
    "coffee beans": ("grocery", ("whole bean", "organic", "fair trade", "dark roast", "medium roast",
                                 "single origin", "low acid", "kosher"),
                     {"size": ("12 oz", "2 lb", "5 lb")}, (8, 60)),
    "protein bars": ("grocery", ("gluten free", "high protein", "low sugar", "keto friendly", "non gmo",
                                 "vegan", "individually wrapped", "no artificial sweeteners"),
                     {"flavor": ("chocolate chip", "peanut butter", "cookie dough", "salted caramel"),
                      "count": ("12 count", "24 count")}, (15, 45)),
    "green tea": ("grocery", ("organic", "decaf", "loose leaf", "tea bags", "antioxidant rich",
                              "non gmo", "kosher", "jasmine"),
                  {"count": ("20 count", "50 count", "100 count")}, (5, 30)),
    "olive oil": ("grocery", ("extra virgin", "cold pressed", "organic", "non gmo", "first harvest",
                              "glass bottle", "kosher", "unfiltered"),
                  {"size": ("500 ml", "1 liter", "3 liter")}, (8, 50)),
    "yoga mat": ("sports", ("non slip", "extra thick", "eco friendly", "carrying strap", "lightweight",
                            "alignment lines", "sweat resistant", "latex free"),
                 {"color": ("purple", "black", "teal", "pink", "grey"),
                  "thickness": ("4mm", "6mm", "8mm")}, (15, 80)),
    "water bottle": ("sports", ("insulated", "bpa free", "leak proof", "stainless steel",
                                "dishwasher safe", "wide mouth", "straw lid", "powder coated"),
                     {"capacity": ("18 oz", "32 oz", "40 oz"),
                      "color": ("black", "white", "mint", "navy", "coral")}, (10, 50)),
    "hiking backpack": ("sports", ("waterproof", "lightweight", "hydration compatible", "padded straps",
                                   "rain cover", "laptop compartment", "ventilated back",
                                   "multiple pockets"),
                        {"capacity": ("20l", "35l", "50l"),
                         "color": ("black", "green", "orange", "grey")},
                        (25, 150)),
    "camping tent": ("sports", ("waterproof", "easy setup", "lightweight", "rainfly", "mesh windows",
                                "freestanding", "double door", "footprint included"),
                     {"capacity": ("2 person", "4 person", "6 person"),
                      "color": ("green", "orange", "blue")},
                     (40, 300)),
}
_DESCRIPTORS = ("Premium", "Classic", "Everyday", "Pro", "Essential", "Deluxe", "Original", "Ultra",
                "Signature", "Basic")
_SYLLABLES = ("vel", "mor", "ka", "lin", "tro", "sa", "ven", "qui", "dor", "el", "ra", "zo", "nix",
              "bel", "ta", "mi", "ro", "ga", "sol", "an")
_STOPWORDS = frozenset(
    "a an and are as at be by find for from i im in is it looking me my need of on or price "
    "lower less than that the this to want with dollars dollar".split())


class Product(NamedTuple):
    pid: str  # "B0" + 8 letters or digits, like an ASIN
    title: str
    category: str
    ptype: str
    attrs: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (kind, offered values), in the type's order
    price: int  # cents


def fmt_price(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


def tokens(text: str) -> list[str]:
    """Lower-case word tokens without stopwords, with a trailing plural ``s`` cut off."""
    out = []
    for tok in re.findall(r"[a-z0-9]+(?:\.[0-9]+)?", text.lower()):
        if tok in _STOPWORDS:
            continue
        out.append(tok[:-1] if len(tok) > 3 and tok.endswith("s") and not tok.endswith("ss") else tok)
    return out


def _brands(rng: random.Random, n: int = 60) -> list[str]:
    names: dict[str, None] = {}
    while len(names) < n:
        names.setdefault("".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).title())
    return list(names)


def _product(rng: random.Random, pid: str, brand: str, ptype: str) -> Product:
    category, pool, kinds, (lo, hi) = TYPES[ptype]
    attrs = tuple(sorted(rng.sample(pool, rng.randint(2, 4)), key=pool.index))
    options = []
    for kind, values in kinds.items():
        offered = set(rng.sample(values, rng.randint(2, len(values))))
        options.append((kind, tuple(v for v in values if v in offered)))
    descriptor = [rng.choice(_DESCRIPTORS)] if rng.random() < 0.4 else []
    words = [brand, *descriptor, *rng.sample(attrs, rng.randint(1, 2)), ptype]
    title = " ".join(w if w[0].isupper() else w.title() for w in words)
    price = rng.randint(lo, hi - 1) * 100 + rng.choice((99, 99, 49, 95, 0))
    return Product(pid, title, category, ptype, attrs, tuple(options), price)


@lru_cache(maxsize=2)
def catalogue(seed: int = SEED, size: int = SIZE) -> tuple[Product, ...]:
    """``size`` products generated from ``seed`` (the same on every machine and process)."""
    rng = random.Random(f"webshop-catalogue:{seed}")
    brands, types = _brands(rng), list(TYPES)
    ids: set[str] = set()
    out = []
    while len(out) < size:
        pid = "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))
        if pid not in ids:
            ids.add(pid)
            out.append(_product(rng, pid, rng.choice(brands), types[len(out) % len(types)]))
    return tuple(out)


@lru_cache(maxsize=1)
def by_id() -> dict[str, Product]:
    return {p.pid: p for p in catalogue()}


def document(p: Product) -> str:
    """The text a product is indexed by: title, type, category, attributes and option values."""
    values = " ".join(v for _, vs in p.options for v in vs)
    return f"{p.title} {p.ptype} {p.category} {' '.join(p.attrs)} {values}"


@lru_cache(maxsize=1)
def _index():
    """The BM25 index over the catalogue (built once per process; about 0.2 s)."""
    from rank_bm25 import BM25Okapi

    return BM25Okapi([tokens(document(p)) for p in catalogue()])


@lru_cache(maxsize=8192)
def search(query: str) -> tuple[str, ...]:
    """Product ids of the best ``MAX_RESULTS`` BM25 matches of ``query`` (score > 0), best first;
    ties keep catalogue order, so results are deterministic."""
    index = _index()
    words = [t for t in tokens(query) if t in index.idf]
    if not words:
        return ()
    scores = index.get_scores(words)
    ranked = np.argsort(-scores, kind="stable")[:MAX_RESULTS].tolist()
    products = catalogue()
    return tuple(products[i].pid for i in ranked if scores[i] > 0)
