"""An LLM judge as a reward source: any OpenAI-compatible chat-completions endpoint scores the episodes
(config: ``agent_trainer.config.rewards.JudgeConfig``, the ``judge`` section; docs/rewards.md, "Judges").

A judge format turns episodes into chat requests and a reply into scores. Formats are registered by name
(``@register_judge_format("pointwise")``) or named by import path "package.module:ClassName" (``judge.mode``):

- ``pointwise``: one request per episode (the rubric, then the episode); the reply's ``{"score": x}``;
- ``ranking``: one request per group holding every episode of the group once, labelled 1..n, scored relative
  to each other (ART's RULER): ``{"scores": [{"trajectory_id": "1", "score": x}, ...]}``.

:class:`JudgeClient` sends the requests, at most ``max_concurrency`` at once, each with ``timeout_s`` and
``max_retries`` (the ``openai`` client's back-off), and keeps the replies in memory keyed by the exact request,
so the same request is never sent twice. A request that fails (timeout, HTTP error, no connection) or whose reply
cannot be parsed leaves its episodes unscored (:attr:`JudgeVerdict.score` None, the reason in ``error``): never
a silent zero. The API key is read from the variable ``api_key_env`` names, held by the ``openai`` client
only, and masked out of any text the endpoint sends back. Replies are untrusted text: parsed as JSON, never run.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agent_trainer.config.rewards import JudgeConfig
from agent_trainer.common.plugins import PluginRegistry


class UnparseableReply(ValueError):
    """A judge reply without the scores its format asks for; the message says what is wrong."""


class JudgeFailure(RuntimeError):
    """More than ``judge.max_unscored_fraction`` of a split's episodes were left unscored in one rollout (or all
    of them): the run stops with this one line (``agent_trainer.main.train``)."""


@dataclass(frozen=True)
class JudgeItem:
    """One episode as the judge reads it."""

    episode: int
    """Its ``traj_uid`` (the env id)."""
    group: int
    """Its ``uid``: the episodes a ranking call compares."""
    text: str


@dataclass
class JudgeCall:
    """One request: the episodes it scores, in the order its reply scores them, and its chat messages."""

    episodes: list[int]
    messages: list[dict[str, str]]


@dataclass
class JudgeVerdict:
    """What the judge made of one episode (written into its trajectory record, shown by the viewer)."""

    mode: str
    score: float | None
    """The parsed score; None = unscored (``error`` says why)."""
    error: str | None = None
    """timeout, HTTP error, connection error or unparseable reply, with the detail."""
    position: int = 1
    """The episode's place in its call, 1..n (ranking: its trajectory id)."""
    call_id: str = ""
    """The reply's ``id`` ("" when no reply came)."""
    cached: bool = False
    """Answered from the cache, without a call."""
    seconds: float = 0.0
    """The call's time (0 for a cached reply)."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """The request's chat messages."""
    reply: str = ""
    """The judge's reply text."""


@dataclass
class Reply:
    """The outcome of sending one call."""

    text: str = ""
    error: str | None = None
    kind: str = "ok"
    """ok | timeout | http (an HTTP error status or no connection) | malformed (a body that is not a completion)."""
    call_id: str = ""
    cached: bool = False
    seconds: float = 0.0


@dataclass
class JudgeStats:
    """Counts of one scoring pass, for its metrics."""

    calls: int = 0
    """Requests sent (cache hits excluded)."""
    cache_hits: int = 0
    timeouts: int = 0
    http_errors: int = 0
    unparseable: int = 0
    """Replies without usable scores (including bodies that are not chat completions).

    ``timeouts``, ``http_errors`` and ``unparseable`` count calls sent, not cache hits."""

    def count(self, reply: Reply, parsed: bool) -> None:
        """Count one call's reply; a cached one counts as a cache hit only."""
        if reply.cached:
            self.cache_hits += 1
            return
        self.calls += 1
        self.timeouts += reply.kind == "timeout"
        self.http_errors += reply.kind == "http"
        self.unparseable += reply.kind == "malformed" or (reply.error is None and not parsed)

    def metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/calls``, ``cache_hits``, ``timeouts``, ``http_errors``, ``unparseable``."""
        return {f"{prefix}/{name}": float(getattr(self, name))
                for name in ("calls", "cache_hits", "timeouts", "http_errors", "unparseable")}


# --------------------------------------------------------------------------- formats


class JudgeFormat(abc.ABC):
    """Requests from episodes, scores from a reply. ``parse`` raises :class:`UnparseableReply`."""

    def __init__(self, config: JudgeConfig):
        self.config = config

    @abc.abstractmethod
    def calls(self, items: list[JudgeItem]) -> list[JudgeCall]:
        """The requests that score ``items``; every episode in exactly one call."""

    @abc.abstractmethod
    def parse(self, reply: str, n: int) -> list[float]:
        """The scores of a call's ``n`` episodes, in its order."""

    def score(self, value: object, what: str) -> float:
        """``value`` as a score in [min_score, max_score]."""
        lo, hi = self.config.min_score, self.config.max_score
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise UnparseableReply(f"{what} is {value!r}, not a number")
        try:
            number = float(value)
        except ValueError:
            raise UnparseableReply(f"{what} is {value!r}, not a number") from None
        if not math.isfinite(number) or not lo <= number <= hi:
            raise UnparseableReply(f"{what} {number:g} is outside [{lo:g}, {hi:g}]")
        return number


JUDGE_FORMATS: PluginRegistry[JudgeFormat] = PluginRegistry(JudgeFormat, "judge.mode")
register_judge_format = JUDGE_FORMATS.register
"""Class decorator: ``@register_judge_format("name")`` makes a format available as ``judge.mode``."""


def json_objects(text: str) -> list[dict]:
    """Every JSON object in ``text`` (a reply may wrap it in prose or a code fence), in order."""
    decoder, found, start = json.JSONDecoder(), [], text.find("{")
    while start != -1:
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            found.append(obj)
        start = text.find("{", end)
    return found


POINTWISE_FORMAT = (
    "\n\nYou are shown one trajectory of an agent, its task and what it did, between <trajectory> tags. "
    "Score it from {lo:g} to {hi:g}. Reply with one JSON object and nothing else: "
    '{{"explanation": "<one sentence>", "score": <a number from {lo:g} to {hi:g}>}}')
_SCORE_TEXT = re.compile(r"\bscore\"?\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


@register_judge_format("pointwise")
class PointwiseJudge(JudgeFormat):
    """One call per episode: the rubric and the reply format as the system message, the episode as the user's."""

    def calls(self, items: list[JudgeItem]) -> list[JudgeCall]:
        system = self.config.rubric + POINTWISE_FORMAT.format(lo=self.config.min_score, hi=self.config.max_score)
        return [JudgeCall([item.episode], [{"role": "system", "content": system},
                                           {"role": "user", "content": f"<trajectory>\n{item.text}\n</trajectory>"}])
                for item in items]

    def parse(self, reply: str, n: int) -> list[float]:
        """The last JSON object's ``score``, else the last ``score: <number>`` in the text."""
        objects = [o for o in json_objects(reply) if "score" in o]
        if objects:
            return [self.score(objects[-1]["score"], "the score")]
        found = _SCORE_TEXT.findall(reply)
        if not found:
            raise UnparseableReply(f"no score in the reply {_excerpt(reply)}")
        return [self.score(found[-1], "the score")]


RANKING_FORMAT = (
    "\n\nYou are shown {n} trajectories of an agent on the same task, each between <trajectory id=\"...\"> tags. "
    "Score every one from {lo:g} to {hi:g}, relative to the others. Reply with one JSON object and nothing else: "
    '{{"scores": [{{"trajectory_id": "1", "explanation": "<one sentence>", "score": <a number from {lo:g} to '
    '{hi:g}>}}, ...]}} with every trajectory id exactly once.')


@register_judge_format("ranking")
class RankingJudge(JudgeFormat):
    """One call per group (RULER): every episode of the group once, labelled 1..n in batch order."""

    def calls(self, items: list[JudgeItem]) -> list[JudgeCall]:
        groups: dict[int, list[JudgeItem]] = {}
        for item in items:
            groups.setdefault(item.group, []).append(item)
        out = []
        for members in groups.values():
            system = self.config.rubric + RANKING_FORMAT.format(n=len(members), lo=self.config.min_score,
                                                                hi=self.config.max_score)
            user = "\n\n".join(f'<trajectory id="{i}">\n{item.text}\n</trajectory>'
                               for i, item in enumerate(members, start=1))
            out.append(JudgeCall([item.episode for item in members],
                                 [{"role": "system", "content": system}, {"role": "user", "content": user}]))
        return out

    def parse(self, reply: str, n: int) -> list[float]:
        """The last JSON object's ``scores``: a list of ``{trajectory_id, score}`` or a mapping id -> score, with
        every id 1..n exactly once."""
        objects = [o for o in json_objects(reply) if "scores" in o]
        if not objects:
            raise UnparseableReply(f'no JSON object with "scores" in the reply {_excerpt(reply)}')
        scores = objects[-1]["scores"]
        if isinstance(scores, dict):
            pairs = list(scores.items())
        elif isinstance(scores, list):
            pairs = [(s.get("trajectory_id"), s.get("score")) if isinstance(s, dict) else (None, s) for s in scores]
        else:
            raise UnparseableReply(f'"scores" is {type(scores).__name__}, not a list')
        ids, found = {str(i) for i in range(1, n + 1)}, {}
        for tid, value in pairs:
            key = str(tid).strip()
            if key not in ids:
                raise UnparseableReply(f"trajectory id {tid!r} is not one of 1..{n}")
            if key in found:
                raise UnparseableReply(f"trajectory {key} is scored twice")
            found[key] = self.score(value, f"the score of trajectory {key}")
        missing = [str(i) for i in range(1, n + 1) if str(i) not in found]
        if missing:
            raise UnparseableReply(f"trajectory {missing[0]} of {n} is not scored")
        return [found[str(i)] for i in range(1, n + 1)]


def _excerpt(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


# --------------------------------------------------------------------------- the client


def request_key(config: JudgeConfig, messages: list[dict[str, str]]) -> str:
    """The cache key of a request: everything that decides the reply (endpoint, model, sampling, messages)."""
    body = [config.base_url, config.model, config.temperature, config.max_tokens, messages]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class JudgeClient:
    """Sends a format's calls to the endpoint (bounded concurrency, timeouts, retries, a cache) and turns the
    replies into one :class:`JudgeVerdict` per episode. Lives on the driver; never pickled."""

    def __init__(self, config: JudgeConfig):
        import openai

        self.config = config
        self.format = JUDGE_FORMATS.get(config.mode)(config)
        self._key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self._client = openai.OpenAI(base_url=config.base_url, api_key=self._key or "no-key", timeout=config.timeout_s,
                                     max_retries=config.max_retries)
        self._cache: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JudgeClient(mode={self.config.mode!r}, base_url={self.config.base_url!r}, model={self.config.model!r})"

    def judge(self, items: list[JudgeItem]) -> tuple[dict[int, JudgeVerdict], JudgeStats]:
        """One verdict per episode of ``items`` (by ``episode``), and the pass's counts."""
        calls, stats, verdicts = self.format.calls(items), JudgeStats(), {}
        if not calls:
            return verdicts, stats
        keys = [request_key(self.config, call.messages) for call in calls]
        first = {key: i for i, key in reversed(list(enumerate(keys)))}  # identical requests in one pass: sent once
        unique = sorted(first.values())
        with ThreadPoolExecutor(max_workers=min(self.config.max_concurrency, len(unique)),
                                thread_name_prefix="judge") as pool:
            sent = dict(zip(unique, pool.map(self.send, [calls[i] for i in unique])))
        replies = [sent[i] if i in sent else dataclasses.replace(sent[first[key]], cached=True, seconds=0.0)
                   for i, key in enumerate(keys)]
        for call, reply in zip(calls, replies):
            scores, error = None, reply.error
            if error is None:
                try:
                    scores = self.format.parse(reply.text, len(call.episodes))
                except UnparseableReply as err:
                    error = f"unparseable reply: {err}"
            stats.count(reply, parsed=scores is not None)
            for position, episode in enumerate(call.episodes):
                verdicts[episode] = JudgeVerdict(
                    mode=self.config.mode, score=None if scores is None else scores[position], error=error,
                    position=position + 1, call_id=reply.call_id, cached=reply.cached, seconds=reply.seconds,
                    messages=call.messages, reply=reply.text)
        return verdicts, stats

    def send(self, call: JudgeCall) -> Reply:
        """The reply to one call: from the cache, or from the endpoint (any failure is a :class:`Reply` with an
        ``error``, never an exception)."""
        import openai

        key = request_key(self.config, call.messages)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is not None:
            return Reply(text=hit[1], call_id=hit[0], cached=True)
        start, cfg = time.monotonic(), self.config
        try:
            completion = self._client.chat.completions.create(
                model=cfg.model, messages=call.messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        except openai.APITimeoutError:
            return Reply(error=f"timeout: no reply within judge.timeout_s = {cfg.timeout_s:g} s (tried "
                               f"{cfg.max_retries + 1} times)", kind="timeout", seconds=time.monotonic() - start)
        except (openai.APIStatusError, openai.APIConnectionError) as err:
            status = getattr(err, "status_code", None)
            what = f"HTTP {status}" if status is not None else "connection error"
            return Reply(error=f"{what}: {self.mask(_excerpt(str(err), 300))}", kind="http",
                         seconds=time.monotonic() - start)
        except openai.OpenAIError as err:
            return Reply(error=f"malformed response: {self.mask(_excerpt(str(err), 300))}", kind="malformed",
                         seconds=time.monotonic() - start)
        seconds = time.monotonic() - start
        try:
            text = self.mask(str(completion.choices[0].message.content or ""))
        except (AttributeError, IndexError, TypeError):
            return Reply(error="unparseable reply: the response is not a chat completion (no choices[0].message)",
                         kind="malformed", seconds=seconds)
        call_id = self.mask(str(getattr(completion, "id", "") or ""))
        if cfg.cache_size:
            with self._lock:
                self._cache[key] = (call_id, text)
                while len(self._cache) > cfg.cache_size:
                    self._cache.popitem(last=False)
        return Reply(text=text, call_id=call_id, seconds=seconds)

    def mask(self, text: str) -> str:
        """``text`` with the API key replaced by ``***`` (an endpoint may echo what it was sent)."""
        return text.replace(self._key, "***") if self._key else text

    def close(self) -> None:
        self._client.close()
