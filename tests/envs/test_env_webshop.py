"""WebShop: catalog format, search index, protocol, reward."""

import json

import pytest

import envs
from envs.bm25 import BM25Index
from envs.data.make_webshop_sample import make_catalog
from envs.webshop import DATA_DIR, get_reward, token_set_ratio


@pytest.fixture(scope="module")
def shop():
    return envs.make_env("webshop")


def test_shipped_catalog_is_regenerable_and_complete():
    items, attrs, human = make_catalog()
    assert json.loads((DATA_DIR / "items_shuffle.json").read_text()) == items
    assert json.loads((DATA_DIR / "items_ins_v2.json").read_text()) == attrs
    assert json.loads((DATA_DIR / "items_human_ins.json").read_text()) == human
    assert len(items) == 100 and len({i["asin"] for i in items}) == 100


def test_bm25_ranks_matching_documents_first():
    index = BM25Index(["red apple pie", "green apple", "blue car", "apple apple apple tart"])
    ranked = [i for i, _ in index.search("apple pie")]
    assert ranked[0] == 0 and 2 not in ranked
    assert index.search("zebra") == []


def test_expert_buys_the_right_product_for_every_goal(shop):
    for seed in range(len(shop.goals)):
        shop.reset(seed=seed)
        for _ in range(20):
            _, reward, done, info = shop.step(shop.expert_action())
            if done:
                break
        assert info["success"] and reward == pytest.approx(1.0), seed


def test_protocol_and_partial_rewards(shop):
    obs = shop.reset(seed=0)
    assert obs.startswith("Instruction: [SEP]") and "search[<your query>]" in obs
    assert shop.step("click[buy now]")[3]["action_is_valid"] is False  # nothing to click on the search page
    assert shop.step("search[]")[3]["action_is_valid"] is False
    obs, _, _, info = shop.step("SEARCH[ dog toy ]")
    assert info["action_is_valid"] and "Page 1 (Total results:" in obs
    assert shop.step("search[again]")[3]["action_is_valid"] is False  # no search bar on results
    goal_asin = shop.goal["asin"]
    wrong = next(a for a in shop.results[:10] if a != goal_asin)
    shop.step(f"click[{wrong}]")
    assert shop.page == "item" and "Buy Now" in shop.render()
    obs, reward, done, info = shop.step("click[buy now]")
    assert done and 0.0 <= reward < 1.0 and not info["success"]
    assert "Your score" in obs


def test_reward_components():
    env = envs.make_env("webshop")
    env.reset(seed=3)
    goal, product = env.goal, env.by_asin[env.goal["asin"]]
    opts = {k: v for k, v in zip(product["options"], goal["goal_options"])}
    assert get_reward(product, goal, product, opts)[0] == pytest.approx(1.0)
    n = len(goal["attributes"]) + len(goal["goal_options"]) + 1
    assert get_reward(product, goal, product, {})[0] == pytest.approx((n - len(goal["goal_options"])) / n)
    pricey = dict(product, price=goal["price_upper"] + 1)
    assert get_reward(pricey, goal, product, opts)[0] == pytest.approx((n - 1) / n)
    assert token_set_ratio("cotton t-shirt", "t-shirt cotton blend") == 100.0


def test_missing_data_explains_how_to_get_it():
    with pytest.raises(ValueError, match="items_path .* does not exist; see docs/environments.md"):
        envs.make_env("webshop", items_path="/no/items.json")
