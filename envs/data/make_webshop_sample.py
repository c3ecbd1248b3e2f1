"""Generate a ~100-product WebShop catalog in WebShop's own JSON formats.

Writes three files into ``envs/data/webshop/`` named like WebShop's data:

- ``items_shuffle.json``: a list of products (``asin``, ``name``, ``category``,
  ``query``, ``product_category`` with " › " separators, ``pricing`` like
  "$12.99", ``small_description`` bullets, ``full_description``,
  ``customization_options`` {name: [{"value": ...}]}, ``images``),
- ``items_ins_v2.json``: {asin: {"attributes": [...]}},
- ``items_human_ins.json``: {asin: [{"instruction", "instruction_attributes",
  "instruction_options"}]}.

Deterministic::

    python -m envs.data.make_webshop_sample
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

OUT_DIR = Path(__file__).parent / "webshop"
BRANDS = ["Northwind", "Lumen", "Acme", "Bluebird", "Cedar & Co", "Vantage", "Orbit", "Maple", "Zephyr", "Kinfolk",
          "Summit", "Harbor"]
COLORS = ["black", "white", "navy blue", "heather grey", "red", "olive green", "pink", "beige"]

# (category, product_category, query, nouns, attribute pool, options, price range)
CATEGORIES = [
    ("fashion", "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts", "men's t-shirts",
     ["t-shirt", "polo shirt", "henley shirt"],
     ["machine washable", "cotton", "short sleeve", "crew neck", "slim fit", "moisture wicking"],
     {"color": COLORS, "size": ["small", "medium", "large", "x-large"]}, (9, 45)),
    ("fashion", "Clothing, Shoes & Jewelry › Women › Shoes › Fashion Sneakers", "women's sneakers",
     ["running shoe", "sneaker", "walking shoe"],
     ["non slip", "rubber sole", "lightweight", "breathable", "memory foam"],
     {"color": COLORS, "size": ["6", "7", "8", "9", "10"]}, (25, 95)),
    ("beauty", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos", "shampoo",
     ["shampoo", "conditioner", "hair mask"],
     ["sulfate free", "paraben free", "natural ingredients", "dry hair", "long lasting"],
     {"size": ["8 fl oz", "16 fl oz", "32 fl oz"], "scent": ["lavender", "coconut", "unscented"]}, (6, 30)),
    ("grocery", "Grocery & Gourmet Food › Snack Foods › Nuts & Seeds", "snack nuts",
     ["almonds", "cashews", "trail mix"],
     ["gluten free", "non gmo", "low sodium", "keto friendly", "high protein"],
     {"flavor": ["sea salt", "honey roasted", "smoked", "unsalted"], "size": ["8 ounce", "1 pound", "2 pound"]},
     (5, 28)),
    ("home", "Home & Kitchen › Bedding › Bed Pillows & Positioners › Bed Pillows", "bed pillows",
     ["bed pillow", "memory foam pillow", "body pillow"],
     ["hypoallergenic", "machine washable", "cooling", "down alternative", "queen size"],
     {"size": ["standard", "queen", "king"], "color": ["white", "grey", "blue"]}, (15, 70)),
    ("electronics", "Electronics › Headphones, Earbuds & Accessories › Earbud Headphones", "wireless earbuds",
     ["wireless earbuds", "bluetooth headphones", "sport earbuds"],
     ["noise cancelling", "water resistant", "long battery life", "fast charging", "built-in microphone"],
     {"color": ["black", "white", "rose gold", "blue"]}, (19, 149)),
    ("furniture", "Home & Kitchen › Furniture › Living Room Furniture › Chairs", "accent chairs",
     ["accent chair", "armchair", "lounge chair"],
     ["easy assembly", "solid wood", "mid century", "living room", "high density foam"],
     {"color": ["beige", "grey", "navy blue", "green"], "material": ["velvet", "linen", "leather"]}, (89, 399)),
    ("sports", "Sports & Outdoors › Exercise & Fitness › Yoga › Mats", "yoga mats",
     ["yoga mat", "exercise mat", "pilates mat"],
     ["non slip", "extra thick", "eco friendly", "carrying strap", "lightweight"],
     {"color": ["purple", "black", "teal", "pink"], "size": ["4mm", "6mm", "10mm"]}, (14, 65)),
    ("pets", "Pet Supplies › Dogs › Toys › Chew Toys", "dog chew toys",
     ["chew toy", "rope toy", "squeaky toy"],
     ["durable", "non toxic", "for large dogs", "dental care", "natural rubber"],
     {"size": ["small", "medium", "large"], "color": ["red", "blue", "orange"]}, (4, 25)),
    ("kitchen", "Home & Kitchen › Kitchen & Dining › Coffee, Tea & Espresso › Coffee Makers", "coffee makers",
     ["coffee maker", "french press", "pour over coffee maker"],
     ["stainless steel", "bpa free", "dishwasher safe", "programmable", "easy to clean"],
     {"color": ["black", "silver", "red"], "size": ["4 cup", "8 cup", "12 cup"]}, (18, 120)),
]


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(8))


def make_catalog(per_category: int = 10, seed: int = 0):
    """(items, attributes, human instructions) dicts in WebShop's formats."""
    rng = random.Random(seed)
    items, attrs, human = [], {}, {}
    for category, product_category, query, nouns, pool, options, (lo, hi) in CATEGORIES:
        for _ in range(per_category):
            asin = _asin(rng)
            noun = rng.choice(nouns)
            product_attrs = rng.sample(pool, 3)
            title_attrs = " ".join(a.title() for a in product_attrs[:2])
            name = f"{rng.choice(BRANDS)} {title_attrs} {noun.title()}"
            opts = {k: sorted(rng.sample(v, min(len(v), rng.randint(2, len(v))))) for k, v in options.items()}
            price = round(rng.uniform(lo, hi), 2)
            bullets = [f"{a.capitalize()}: designed to be {a}." for a in product_attrs]
            items.append({
                "asin": asin, "name": name, "category": category, "query": query,
                "product_category": product_category, "pricing": f"${price:.2f}",
                "small_description": bullets,
                "full_description": f"The {name} is a {', '.join(product_attrs)} {noun}.",
                "customization_options": {k: [{"value": v, "image": None} for v in vs] for k, vs in opts.items()},
                "images": [f"https://example.invalid/{asin}.jpg"],
            })
            attrs[asin] = {"attributes": product_attrs}
            goal_attrs = rng.sample(product_attrs, rng.randint(1, 2))
            goal_opts = [rng.choice(vs) for vs in opts.values()]
            opt_text = ", ".join(f"{k} {v}" if k != "color" else f"{v} color" for k, v in zip(opts, goal_opts))
            human[asin] = [{
                "instruction": f"i'm looking for a {' and '.join(goal_attrs)} {noun} with {opt_text}",
                "instruction_attributes": goal_attrs,
                "instruction_options": goal_opts,
            }]
    rng.shuffle(items)  # WebShop ships items_shuffle: products in random order
    return items, attrs, human


def main() -> None:
    """Write the three catalog files."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-category", type=int, default=10)
    parser.add_argument("--out-dir", default=str(OUT_DIR))
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items, attrs, human = make_catalog(args.per_category)
    for fname, data in [("items_shuffle.json", items), ("items_ins_v2.json", attrs),
                        ("items_human_ins.json", human)]:
        (out / fname).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(items)} products to {out}")


if __name__ == "__main__":
    main()
