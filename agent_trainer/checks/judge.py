"""Start-up checks of the ``judge`` section (``agent_trainer.config.rewards.JudgeConfig``), before ``ray.init``:
an endpoint to call, a key to call it with, and no judge key that would be ignored. Each refusal is one line
naming the key, the value and the fix; the API key itself is never part of a message."""

from __future__ import annotations

import os
import re
from urllib.parse import urlparse

from agent_trainer import core_algos
from agent_trainer.checks.rules import changed_keys, check, get_key
from agent_trainer.config.rewards import JudgeConfig
from agent_trainer.config.schema import AgentTrainerConfig

_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_judge(cfg: AgentTrainerConfig) -> None:
    """judge.*: refused in one line when it cannot work (the format name is checked in ``checks.plugins``)."""
    judge = cfg.judge
    if not judge.enable:
        changed = changed_keys(judge, JudgeConfig(), "judge")
        if changed:
            key = changed[0]
            value = "(not shown)" if key == "judge.api_key_env" else repr(get_key(cfg, key))[:80]
            check(False, f"{key} = {value} is set but judge.enable = False, so no episode is judged; set "
                         "judge.enable=true or drop it")
        return
    url = urlparse(judge.base_url)
    check(url.scheme in ("http", "https") and bool(url.netloc),
          f"judge.base_url = {judge.base_url!r} must be the http:// or https:// base URL of an OpenAI-compatible API; "
          "e.g. judge.base_url=http://127.0.0.1:8000/v1 or https://api.openai.com/v1")
    check(bool(judge.model.strip()), f"judge.model = {judge.model!r} must name the judge model at judge.base_url; "
                                     "e.g. judge.model=gpt-4.1-mini")
    if judge.api_key_env:
        check(bool(_VARIABLE_NAME.fullmatch(judge.api_key_env)),
              "judge.api_key_env must be the NAME of an environment variable (letters, digits and _), not a key "
              "(the value is not shown here in case it is one); e.g. export OPENAI_API_KEY=... and set "
              "judge.api_key_env=OPENAI_API_KEY")
        check(bool(os.environ.get(judge.api_key_env)),
              f"judge.api_key_env = {judge.api_key_env!r} names an environment variable that is not set (or is "
              f"empty); export {judge.api_key_env}=<the key> before the run, or set judge.api_key_env='' for an "
              "endpoint without a key")
    check(judge.min_score < judge.max_score,
          f"judge.min_score = {judge.min_score!r} must be below judge.max_score = {judge.max_score!r}; "
          "e.g. judge.min_score=0 judge.max_score=1")
    estimator = core_algos.estimator(cfg.algorithm)
    check(not core_algos.estimator_spec(estimator).greedy_baseline,
          f"judge.enable = True with algorithm.adv_estimator = {estimator!r}: the greedy baseline episodes are not "
          "judged, so the baseline would miss the judge's reward; pick algorithm.adv_estimator=grpo")
