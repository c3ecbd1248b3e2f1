"""Live run metrics through ``ray.util.metrics``: the node's Prometheus endpoint and the dashboard's Metrics page.

Ray exports every metric with a ``ray_`` prefix on each node's metrics port
(``ray.nodes()[i]["MetricsExportPort"]``, ``http://<node>:<port>/metrics``), a few seconds
after it is set. Every series carries the tag ``experiment`` (``trainer.experiment_name``).

| metric (exported as ``ray_<name>``) | kind | tags | from the step's metrics |
| --- | --- | --- | --- |
| ``agent_trainer_step`` | gauge | | the global step |
| ``agent_trainer_success_rate`` | gauge | split, env_tag | ``env/<tag>/success``, ``val/env/<tag>/success`` |
| ``agent_trainer_episode_reward_mean`` | gauge | split, env_tag | ``env/<tag>/episode_reward_mean`` (all: ``rollout/...``) |
| ``agent_trainer_generated_tokens_per_s`` | gauge | | ``perf/generated_tokens_per_s`` |
| ``agent_trainer_env_steps_per_s`` | gauge | | ``perf/env_steps_per_s`` |
| ``agent_trainer_phase_seconds`` | gauge | phase | ``timing_s/<phase>`` |
| ``agent_trainer_weight_sync_seconds`` | gauge | | ``timing_s/sync`` |
| ``agent_trainer_async`` | gauge | quantity | ``trainer.max_off_policy_steps`` >= 1: ``in_flight_episodes``, ``buffered``, ``versions_in_batch``, ``policy_staleness`` (max), ``policy_staleness_frac/<j>`` (the histogram), ``stale_dropped``, ``in_flight_syncs`` (each ``rollout/<quantity>``) |
| ``agent_trainer_engine_restarts`` | counter | | ``rollout/engine_failures`` |
| ``agent_trainer_env_errors`` | counter | | ``rollout/env_actor_failures`` + ``rollout/env_timeouts`` |
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_trainer.rollout import RolloutResult

PREFIX = "agent_trainer_"
_TAG_METRIC = re.compile(r"^(?:(val)/)?env/([^/]+)/(success|episode_reward_mean)$")


ASYNC_GAUGES = ("in_flight_episodes", "buffered", "versions_in_batch", "policy_staleness", "stale_dropped",
                "in_flight_syncs")
"""The ``rollout/<quantity>`` metrics the ``async`` gauge exports (with the staleness histogram)."""


def rollout_rates(result: RolloutResult, metrics: dict[str, float], prefix: str = "rollout") -> dict[str, float]:
    """The rollout's throughput: ``perf/generated_tokens_per_s`` and ``perf/env_steps_per_s`` over
    ``timing_s/rollout`` (the per-tag ``env/<tag>/episode_reward_mean`` the gauge exports is the rollout's
    own metric, over the one per-episode reward figure, ``agent_trainer.rollout.results.episode_rewards``)."""
    out: dict[str, float] = {}
    if prefix == "rollout":
        actions = sum(float(s.metrics.get("num_actions", 0.0)) for s in result.states)
        seconds = max(metrics.get("timing_s/rollout", 0.0), 1e-9)
        out["perf/generated_tokens_per_s"] = float(result.batch["response_mask"].sum()) / seconds
        out["perf/env_steps_per_s"] = actions / seconds
    return out


def tag_gauges(metrics: dict[str, float]) -> dict[tuple[str, str, str], float]:
    """The per-tag gauges a step's metrics set: (gauge name without the prefix, split, env tag) -> value, from
    ``env/<tag>/success|episode_reward_mean`` (split train) and ``val/env/<tag>/...`` (split val)."""
    out = {}
    for key, value in metrics.items():
        if match := _TAG_METRIC.match(key):
            name = "success_rate" if match.group(3) == "success" else "episode_reward_mean"
            out[(name, match.group(1) or "train", match.group(2))] = float(value)
    return out


class RayMetrics:
    """The run's ``ray.util.metrics`` gauges and counters; :meth:`export` sets them from one step's metrics."""

    def __init__(self, experiment: str):
        from ray.util.metrics import Counter, Gauge

        self.tags = {"experiment": experiment}
        keys = ("experiment",)

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(PREFIX + name, description=doc, tag_keys=keys + extra)

        self.step = gauge("step", "Global training step of the run.")
        self.success = gauge("success_rate", "Episode success rate per split and env tag.", "split", "env_tag")
        self.reward = gauge("episode_reward_mean", "Mean episode reward per split and env tag.", "split", "env_tag")
        self.tokens_per_s = gauge("generated_tokens_per_s", "Tokens the engines generated per rollout second.")
        self.env_steps_per_s = gauge("env_steps_per_s", "Environment actions executed per rollout second.")
        self.phase = gauge("phase_seconds", "Seconds of each phase of the last step.", "phase")
        self.sync = gauge("weight_sync_seconds", "Seconds of the last actor-to-engine weight sync.")
        self.asynchronous = gauge("async", "Asynchronous training: episodes in flight, buffered batches, policy "
                                  "versions and staleness of the step's batch, stale episodes dropped.", "quantity")
        self.restarts = Counter(PREFIX + "engine_restarts", description="Rollout engine failures (restarted).",
                                tag_keys=keys)
        self.env_errors = Counter(PREFIX + "env_errors", description="Env actor failures and timeouts.",
                                  tag_keys=keys)

    def export(self, metrics: dict[str, float], step: int) -> None:
        """Set every gauge the step's metrics have; add the step's failures to the counters."""
        tags = self.tags
        self.step.set(step, tags=tags)
        for key, value in metrics.items():
            if key.startswith("timing_s/"):
                self.phase.set(value, tags={**tags, "phase": key.removeprefix("timing_s/")})
        for (name, split, env_tag), value in tag_gauges(metrics).items():
            gauge = self.success if name == "success_rate" else self.reward
            gauge.set(value, tags={**tags, "split": split, "env_tag": env_tag})
        for key, gauge in (("perf/generated_tokens_per_s", self.tokens_per_s),
                           ("perf/env_steps_per_s", self.env_steps_per_s), ("timing_s/sync", self.sync)):
            if key in metrics:
                gauge.set(metrics[key], tags=tags)
        if "rollout/in_flight_episodes" in metrics:  # trainer.max_off_policy_steps >= 1
            for key, value in metrics.items():
                quantity = key.removeprefix("rollout/")
                if quantity in ASYNC_GAUGES or quantity.startswith("policy_staleness_frac/"):
                    self.asynchronous.set(value, tags={**tags, "quantity": quantity})
        restarts = metrics.get("rollout/engine_failures", 0.0)
        errors = metrics.get("rollout/env_actor_failures", 0.0) + metrics.get("rollout/env_timeouts", 0.0)
        if restarts > 0:
            self.restarts.inc(restarts, tags=tags)
        if errors > 0:
            self.env_errors.inc(errors, tags=tags)


def prometheus_urls() -> list[str]:
    """Each alive node's Prometheus endpoint (needs ``ray.init``)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]
