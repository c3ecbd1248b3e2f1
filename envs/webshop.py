"""WebShop: find and buy the product an instruction describes.

The task protocol of WebShop (Yao et al., 2022) in its text mode: pages are
rendered as elements separated by ``[SEP]``; actions are ``search[query]`` on
the search page and ``click[element]`` on any clickable element (a product id,
an option value, ``next >``, ``< prev``, ``back to search``, ``description``,
``features``, ``reviews``, ``buy now``). ``click[buy now]`` ends the episode
with WebShop's reward: the share of goal attributes, goal options and the
price limit the bought product meets, times a product-type factor. An episode
succeeds when that reward is 1.

Data: WebShop's JSON files (``items_shuffle*.json``, ``items_ins_v2*.json``,
``items_human_ins.json``). By default a generated 100-product catalog in
``envs/data/webshop`` (``python -m envs.data.make_webshop_sample``); point the
three paths at WebShop's ``data/`` files to use the real catalog. Search is a
BM25 index over titles, bullet points, descriptions and categories.

Differences from the original, for an offline, dependency-free setup: the
product-type score compares non-stopword title tokens instead of spaCy nouns,
fuzzy matching uses difflib instead of thefuzz, colours are not normalised,
and a price range uses its lower end.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import BaseEnv, make_info
from envs.bm25 import BM25Index, tokenize

DATA_DIR = Path(__file__).parent / "data" / "webshop"
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # WebShop's goal price limits
EXACT_MATCH_OPTS = ["size"]
_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
_STOPWORDS = set("a an and the for with of in on to by from is are be it this that & - s".split())
LEGEND = ("Pages list their elements separated by [SEP]. Product ids (e.g. B0ABC12345) and option values "
          "are clickable; the current options are shown as 'Selected options'.")


@dataclass
class WebShopConfig:
    """Options of the WebShop environment."""

    items_path: str = str(DATA_DIR / "items_shuffle.json")
    """WebShop products file (a JSON list)."""
    attrs_path: str = str(DATA_DIR / "items_ins_v2.json")
    """Product attributes file ({asin: {"attributes": [...]}})."""
    human_ins_path: str = str(DATA_DIR / "items_human_ins.json")
    """Human instructions file ({asin: [{"instruction", "instruction_attributes", "instruction_options"}]})."""
    num_products: int | None = None
    """Use only the first N products (None: all)."""
    search_return_n: int = 50
    """Results returned by a search."""
    product_window: int = 10
    """Results per page."""

    def __post_init__(self):
        for key in ("items_path", "attrs_path", "human_ins_path"):
            if not Path(getattr(self, key)).exists():
                raise ValueError(f"{key} {getattr(self, key)!r} does not exist; see docs/environments.md "
                                 f"(WebShop) for how to get WebShop's data files")
        for key in ("search_return_n", "product_window"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive int, got {getattr(self, key)!r}")


def load_catalog(config: WebShopConfig) -> tuple[list[dict], list[dict]]:
    """Products (cleaned like WebShop's load_products) and human goals without prices."""
    raw = json.loads(Path(config.items_path).read_text())
    attrs = json.loads(Path(config.attrs_path).read_text())
    human = json.loads(Path(config.human_ins_path).read_text())
    if config.num_products is not None:
        raw = raw[: config.num_products]
    products, seen = [], set()
    for p in raw:
        asin = str(p.get("asin", ""))
        if asin in seen or asin == "nan" or len(asin) > 10:
            continue
        seen.add(asin)
        bullets = p.get("small_description") or []
        prices = _parse_pricing(p.get("pricing"))
        options = {}
        for name, contents in (p.get("customization_options") or {}).items():
            if contents:
                options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
        products.append({
            "asin": asin, "Title": p.get("name", ""), "name": p.get("name", ""),
            "Description": p.get("full_description") or "",
            "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
            "category": p.get("category", ""), "query": str(p.get("query", "")).lower().strip(),
            "product_category": p.get("product_category", ""), "price": prices[0],
            "Price": f"${prices[0]}" if len(prices) == 1 else f"${prices[0]} to ${prices[1]}",
            "options": options, "Attributes": attrs.get(asin, {}).get("attributes", ["DUMMY_ATTR"]),
        })
    by_asin = {p["asin"]: p for p in products}
    goals = []
    for asin, instructions in human.items():
        if asin not in by_asin:
            continue
        for ins in instructions:
            if ins.get("instruction_attributes"):
                goals.append({"asin": asin, "instruction": ins["instruction"].strip("."),
                              "attributes": ins["instruction_attributes"],
                              "goal_options": ins.get("instruction_options") or []})
    if not goals:
        raise ValueError(f"no goals: {config.human_ins_path} has no instructions for the loaded products")
    return products, goals


def _parse_pricing(pricing: Any) -> list[float]:
    if not pricing:
        return [100.0]
    try:
        prices = [float(Decimal(re.sub(r"[^\d.]", "", x))) for x in str(pricing).split("$")[1:]]
    except InvalidOperation:
        return [100.0]
    return prices[:2] or [100.0]


@functools.lru_cache(maxsize=4)
def _shared_catalog(items_path: str, attrs_path: str, human_ins_path: str, num_products: int | None):
    """Catalog, goals and search index, built once per process and shared (read-only) by all episodes."""
    cfg = WebShopConfig(items_path=items_path, attrs_path=attrs_path, human_ins_path=human_ins_path,
                        num_products=num_products)
    products, goals = load_catalog(cfg)
    index = BM25Index([" ".join([p["Title"], p["query"], p["product_category"], p["Description"],
                                 *p["BulletPoints"]]) for p in products])
    return products, goals, {p["asin"]: p for p in products}, index


# --------------------------------------------------------------------------- reward (WebShop's goal.py)


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio() * 100


def token_set_ratio(a: str, b: str) -> float:
    """thefuzz's token_set_ratio on difflib: 0..100, 100 when one token set contains the other."""
    ta, tb = set(tokenize(a)), set(tokenize(b))
    inter = " ".join(sorted(ta & tb))
    da, db = " ".join(sorted(ta - tb)), " ".join(sorted(tb - ta))
    sa, sb = f"{inter} {da}".strip(), f"{inter} {db}".strip()
    if inter and (not da or not db):
        return 100.0
    return max(_ratio(inter, sa), _ratio(inter, sb), _ratio(sa, sb))


def _in_text(value: str, product: dict) -> bool:
    v = value.lower()
    return (v in product["Title"].lower() or v in " ".join(product["BulletPoints"]).lower()
            or v in product["Description"].lower())


def get_reward(product: dict, goal: dict, goal_product: dict, options: dict[str, str]) -> tuple[float, dict]:
    """WebShop's total reward for buying ``product`` with ``options`` under ``goal``."""
    query_match = product["query"] == goal_product["query"]
    cats = lambda p: {x.strip() for x in p["product_category"].split("›")}  # noqa: E731
    category_match = len(cats(product) & cats(goal_product)) >= 2
    want = [t for t in tokenize(goal_product["name"]) if t not in _STOPWORDS]
    have = {t for t in tokenize(product["name"]) if t not in _STOPWORDS}
    title_score = len(set(want) & have) / len(set(want)) if want else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    n_att = 0
    for g in goal["attributes"]:
        if any(token_set_ratio(p, g) > 85 for p in product["Attributes"]) or _in_text(g, product):
            n_att += 1
    goal_opts = [o.lower() for o in goal["goal_options"]]
    n_opt = 0
    for key, value in options.items():
        if key.lower() in EXACT_MATCH_OPTS:
            matched = value in goal_opts
        else:
            matched = any(token_set_ratio(g, value) > 85 for g in goal_opts)
        n_opt += bool(matched or _in_text(value, product))
    r_price = product["price"] <= goal["price_upper"]
    total = (n_att + n_opt + r_price) / (len(goal["attributes"]) + len(goal_opts) + 1) * r_type
    return total, {"r_type": r_type, "r_att": n_att / len(goal["attributes"]), "r_price": float(r_price)}


# --------------------------------------------------------------------------- environment


class WebShopEnv(BaseEnv):
    """Search, browse and buy over a product catalog; rewarded at purchase."""

    config_cls = WebShopConfig

    def __init__(self, config: WebShopConfig | None = None):
        """Load the catalog and build the search index."""
        super().__init__(config)
        self.products, self.goals, self.by_asin, self.index = _shared_catalog(
            self.config.items_path, self.config.attrs_path, self.config.human_ins_path, self.config.num_products)
        self.goal: dict = {}
        self._reset_state()

    def _reset_state(self) -> None:
        self.page, self.results, self.page_num = "search", [], 1
        self.asin, self.selected, self.detail = None, {}, ""
        self.done, self.reward, self.success, self.reward_parts = False, 0.0, False, {}
        self.query = ""
        self._expert_fallback = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Pick the goal (and its price limit) for ``seed``; start on the search page."""
        rng = np.random.default_rng(seed)
        goal = dict(self.goals[int(rng.integers(len(self.goals)))])
        price = self.by_asin[goal["asin"]]["price"]
        above = [p for p in PRICE_RANGE if p > price][:4]
        if len(above) >= 2:
            goal["price_upper"] = float(sorted(rng.choice(above, 2, replace=False))[1])
            goal["instruction_text"] = f"{goal['instruction']}, and price lower than {goal['price_upper']:.2f} dollars"
        else:
            goal["price_upper"], goal["instruction_text"] = 1e6, goal["instruction"]
        self.goal = goal
        self._reset_state()
        return self.render()

    def clickables(self) -> list[str]:
        """Lower-case names of the clickable elements on the current page."""
        if self.page == "results":
            out = ["back to search"] + (["< prev"] if self.page_num > 1 else [])
            if self.page_num * self.config.product_window < len(self.results):
                out.append("next >")
            return out + [a.lower() for a in self._page_asins()]
        if self.page == "item":
            opts = [v for vs in self.by_asin[self.asin]["options"].values() for v in vs]
            return ["back to search", "< prev", *opts, "description", "features", "reviews", "buy now"]
        if self.page == "detail":
            return ["back to search", "< prev"]
        return []

    def _page_asins(self) -> list[str]:
        w = self.config.product_window
        return self.results[(self.page_num - 1) * w: self.page_num * w]

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Apply ``search[...]`` / ``click[...]``; anything else is invalid."""
        m = _ACTION.match(action) if isinstance(action, str) and len(action) <= 500 else None
        if m is None or self.done:
            return self.render(), 0.0, self.done, make_info(self.success, m is not None, False)
        verb, arg = m.group(1).lower(), m.group(2).strip()
        if verb == "search":
            if self.page != "search" or not tokenize(arg):
                return self.render(), 0.0, False, make_info(False, False, False)
            self.results = [self.products[i]["asin"] for i, _ in self.index.search(arg, self.config.search_return_n)]
            self.page, self.page_num, self.query = "results", 1, arg
            return self.render(), 0.0, False, make_info(False, True, True)
        target = arg.lower()
        if target not in self.clickables():
            return self.render(), 0.0, False, make_info(False, False, False)
        reward = self._click(target)
        extra = self.reward_parts if self.done else {}  # r_type / r_att / r_price become episode metrics
        return self.render(), reward, self.done, make_info(self.success, True, True, **extra)

    def _click(self, target: str) -> float:
        if target == "back to search":
            self.page, self.asin, self.selected = "search", None, {}
        elif target == "next >":
            self.page_num += 1
        elif target == "< prev":
            if self.page == "results":
                self.page_num -= 1
            elif self.page == "item":
                self.page, self.asin, self.selected = "results", None, {}
            else:
                self.page = "item"
        elif self.page == "results":
            self.page, self.asin, self.selected = "item", next(a for a in self.results if a.lower() == target), {}
        elif target in ("description", "features", "reviews"):
            self.page, self.detail = "detail", target
        elif target == "buy now":
            product = self.by_asin[self.asin]
            self.reward, self.reward_parts = get_reward(product, self.goal, self.by_asin[self.goal["asin"]],
                                                        self.selected)
            self.done, self.success = True, self.reward >= 1.0 - 1e-9
            return float(self.reward)
        else:  # an option value
            for name, values in self.by_asin[self.asin]["options"].items():
                if target in values:
                    self.selected[name] = target
                    break
        return 0.0

    def render(self) -> str:
        """The current page as WebShop's [SEP]-separated text, then the available actions."""
        head = f"Instruction: [SEP] {self.goal.get('instruction_text', '')}"
        if self.done:
            return f"{head} [SEP] Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {self.reward:.2f}"
        if self.page == "search":
            body = "Search"
        elif self.page == "results":
            parts = ["Back to Search", f"Page {self.page_num} (Total results: {len(self.results)})"]
            parts += ["< Prev"] if self.page_num > 1 else []
            parts += ["Next >"] if "next >" in self.clickables() else []
            for a in self._page_asins():
                parts += [a, self.by_asin[a]["Title"], self.by_asin[a]["Price"]]
            body = " [SEP] ".join(parts)
        elif self.page == "item":
            p = self.by_asin[self.asin]
            parts = ["Back to Search", "< Prev"]
            for name, values in p["options"].items():
                parts += [name, *values]
            parts += [p["Title"], f"Price: {p['Price']}", "Rating: N.A.", "Description", "Features", "Reviews",
                      "Buy Now"]
            body = " [SEP] ".join(parts)
            if self.selected:
                body += " [SEP] Selected options: " + ", ".join(f"{k}: {v}" for k, v in self.selected.items())
        else:
            p = self.by_asin[self.asin]
            text = {"description": p["Description"], "features": " [SEP] ".join(p["BulletPoints"]),
                    "reviews": "No reviews."}[self.detail]
            body = f"Back to Search [SEP] < Prev [SEP] {text}"
        return f"{head} [SEP] {body}\nAvailable actions: {self.action_description()}"

    def action_description(self) -> str:
        """Actions valid on the current page."""
        if self.done:
            return "none (episode finished)"
        if self.page == "search":
            return "search[<your query>]"
        return " | ".join(f"click[{c}]" for c in self.clickables())

    def legend(self) -> str:
        """How pages are rendered."""
        return LEGEND

    def expert_action(self) -> str:
        """Oracle: search the instruction, open the goal product, pick its options, buy."""
        goal_asin = self.goal["asin"]
        if self.page == "search":
            query = self.by_asin[goal_asin]["Title"] if self._expert_fallback else self.goal["instruction"]
            return f"search[{query}]"
        if self.page == "results":
            if goal_asin in self._page_asins():
                return f"click[{goal_asin.lower()}]"
            if "next >" in self.clickables():
                return "click[next >]"
            self._expert_fallback = True  # not found by the instruction: search the title instead
            return "click[back to search]"
        if self.page == "detail" or self.asin != goal_asin:
            return "click[< prev]"
        clickable = set(self.clickables())
        for opt in (o.lower() for o in self.goal["goal_options"]):
            if opt in clickable and opt not in self.selected.values():
                return f"click[{opt}]"
        return "click[buy now]"
