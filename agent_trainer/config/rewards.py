"""Config of prompt datasets and reward sources (verl's ``data``, ``reward`` sections).

Imported by ``agent_trainer.config`` (the sections of :class:`AgentTrainerConfig`); the
validation rules live in ``agent_trainer.checks``, the dataset env tags they
become are built by :func:`agent_trainer.episode.prompt_data.dataset_env_tags`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRAIN_TAG = "PromptData"
"""The env tag ``data.train_files`` becomes (name it in ``es_manager.train.env_configs.tags``)."""
VAL_TAG = "PromptDataVal"
"""The env tag ``data.val_files`` becomes (name it in ``es_manager.val.env_configs.tags``)."""


@dataclass
class DataConfig:
    """Prompt datasets (verl's ``data`` section), played as episodes of the ``prompt_dataset`` env."""

    train_files: list[str] = field(default_factory=list)
    """Training data: JSON, JSONL, TXT (one prompt a line) or parquet files, or RAGEN split folders holding
    prompts.json. Non-empty = the env tag PromptData exists (use it in es_manager.train.env_configs.tags)."""
    val_files: list[str] = field(default_factory=list)
    """Validation data, same formats; the env tag PromptDataVal (empty = validate on train_files' rows)."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: plain text or chat messages ([{role, content}, ...])."""
    ground_truth_key: str = "reward_model.ground_truth"
    """Dotted path of a row's ground truth (verl's parquet rows); rows without it have none."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens (the policy's tokenizer, prompt text only); a longer row is refused at start-up
    naming its file and line (policy: error; shorten the row or raise this)."""
    shuffle: bool = True
    """Walk each epoch in a random order seeded by trainer.seed (else file order)."""
    max_turns: int = 1
    """Turns per question: 1 = single-turn (the first answer is scored); more = the question environment, each
    turn a reasoning step until an answer containing final_marker (or the last turn). At most agent_proxy.max_turn."""
    final_marker: str = "Final answer:"
    """With max_turns > 1: the text marking an answer as final; the text after it is scored."""
    instruction: str = "Answer the question. Give only the final answer inside <answer></answer>."
    """The task text shown before each prompt (the tag's env_instruction)."""


@dataclass
class CustomRewardFunctionConfig:
    """verl's ``reward.custom_reward_function``: a Python function scoring dataset answers."""

    path: str = ""
    """.py file defining the function ("" = the default math scorer: 1.0 when the answer equals the ground
    truth as a number, fraction or normalised LaTeX, else 0.0)."""
    name: str = "compute_score"
    """The function: compute_score(data_source, solution_str, ground_truth, extra_info) -> float."""


@dataclass
class RewardConfig:
    """Rewards of prompt-dataset episodes (docs/rewards.md)."""

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)


RM_INPUTS = ("response", "conversation")
"""What the reward model reads: the decoded final reply, or the whole conversation (chat template included)."""


@dataclass
class RewardModelModelConfig:
    """Which sequence-classification checkpoint the reward model loads."""

    path: str = ""
    """Hugging Face folder or hub id of an AutoModelForSequenceClassification with one label (e.g.
    models/tiny-qwen2-rm, built by `make model`). Required when reward_model.enable."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16."""


@dataclass
class RewardModelConfig:
    """verl's ``reward_model`` section: a RewardModelWorker group (FSDP2) scoring each episode."""

    enable: bool = False
    """Start the reward-model workers; each episode's score (times reward_weight) is added on its last
    generated token, next to the environment's rewards (docs/rewards.md)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    input: str = "response"
    """response: the decoded text of the episode's last reply | conversation: the episode's whole token
    sequence decoded (prompt, every turn, chat template), up to its last generated token."""
    reward_weight: float = 1.0
    """Multiplies the score before it is added to the environment rewards."""
    max_length: int = 2048
    """Most tokens the reward model reads per text; a longer text keeps its last max_length tokens."""
    micro_batch_size_per_gpu: int = 4
    """Texts per forward on one rank."""
    world_size: int = 1
    """Reward-model ranks (FSDP2 shards the model across them)."""
    num_cpus_per_rank: float = 0.25
    """Ray CPU accounting per rank."""
    dump_scores: bool = False
    """Append every scored text and its score to <trainer.default_local_dir>/reward_model_scores.jsonl."""


JUDGE_RUBRIC = (
    "Judge how well the agent did the task it was given.\n"
    "- A trajectory that reaches the task's goal scores well above one that does not.\n"
    "- Of two trajectories that reach the goal, the more direct one (fewer wasted steps) scores higher.\n"
    "- Progress towards the goal without reaching it earns partial credit.\n"
    "- A small difference in quality gives a small difference in score, a large one a large difference.")
"""``judge.rubric``'s default (the criteria of ART's RULER in our words)."""


@dataclass
class JudgeConfig:
    """``judge``: an LLM judge behind any OpenAI-compatible chat-completions endpoint scoring every episode
    (docs/rewards.md, "Judges"). The score (times reward_weight) is added on the episode's last generated token;
    an episode the judge could not score is left out of its group's statistics and of the update, and counted."""

    enable: bool = False
    """Score every training and validation episode with the judge."""
    mode: str = "pointwise"
    """pointwise: one call per episode, the rubric and the episode, a parsed score | ranking: one call per group
    with all of its episodes, scored relative to each other (RULER) | a registered judge format, or
    "package.module:ClassName"."""
    base_url: str = ""
    """The endpoint's OpenAI base URL, http:// or https://, e.g. https://api.openai.com/v1 or
    http://127.0.0.1:8000/v1 (a local vLLM server). Required when enable."""
    model: str = ""
    """The judge model's name at that endpoint, e.g. gpt-4.1-mini. Required when enable."""
    api_key_env: str = ""
    """The NAME of the environment variable holding the API key (e.g. OPENAI_API_KEY), which must be set when the
    run starts; the key itself is never written to the config, the logs, the trajectories or a checkpoint.
    "" = send no key (a local server without one)."""
    input: str = "conversation"
    """What the judge reads of each episode: conversation (the whole token sequence decoded, prompt and every
    turn, up to the last generated token) | response (the last reply alone)."""
    rubric: str = JUDGE_RUBRIC
    """The criteria, first in the judge's system prompt; the reply format follows it."""
    min_score: float = 0.0
    """Lowest score the judge may give; a score outside [min_score, max_score] is an unparseable reply."""
    max_score: float = 1.0
    """Highest score the judge may give."""
    reward_weight: float = 1.0
    """Multiplies the judge's score before it is added to the (weighted) environment rewards."""
    env_reward_weight: float = 1.0
    """Multiplies the environment's rewards of every episode (0 = the judge's score alone)."""
    temperature: float = 0.0
    """The judge's sampling temperature."""
    max_tokens: int = 1024
    """Most tokens of one judge reply."""
    timeout_s: float = 60.0
    """Seconds one call may take before it is abandoned (then retried)."""
    max_retries: int = 2
    """Retries of a call that timed out, could not connect or got HTTP 408, 409, 429 or 5xx (with back-off)."""
    max_concurrency: int = 8
    """Calls in flight at once."""
    cache_size: int = 10000
    """Replies kept in memory by their exact request: the same request is answered from here without a call
    (0 = no cache)."""
    max_unscored_fraction: float = 0.5
    """More than this fraction of a split's episodes left unscored in one rollout stops the run, naming the first
    failure (a judge that is down or answers nothing usable); below it they are counted and left out."""


DOMAINS = ("general", "math", "coding")
"""reward_computation.domain: how answers are checked."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    wall_s: float = 5.0
    """Wall-clock seconds before the process group is killed."""
    cpu_s: int = 3
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    mem_mb: int = 512
    """Address space per process in MiB (RLIMIT_AS); a larger allocation raises MemoryError."""
    max_output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; more kills the run."""
    max_procs: int = 32
    """Processes and threads of the sandbox uid (RLIMIT_NPROC)."""
    max_file_mb: int = 16
    """Largest file the program may write, in MiB (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "mem_mb", "max_output_bytes", "max_procs", "max_file_mb", "max_open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox.{name} = {value!r} must be a positive number")



@dataclass
class FormatValidationConfig:
    """``reward_computation.format_validation``: rules a trajectory must meet, else reward 0."""

    require_answer_tag: bool = True
    """The final output holds <answer>...</answer>; the answer is its content (else the whole final output)."""
    require_think_tag: bool = False
    """A <think>...</think> block comes before the <answer> block in the final output."""
    max_answer_chars: int = 4096
    """Longest accepted answer in characters (0 = no limit)."""
    require_nonempty_outputs: bool = True
    """Every step's output has non-blank text."""
    require_boxed: bool = False
    """Math: the answer contains \\boxed{...}."""
    require_code_block: bool = False
    """Coding: the answer contains a fenced ``` code block."""

    def __post_init__(self):
        if isinstance(self.max_answer_chars, bool) or not isinstance(self.max_answer_chars, int) \
                or self.max_answer_chars < 0:
            raise ValueError(f"reward_computation.format_validation.max_answer_chars = {self.max_answer_chars!r} "
                             "must be an int >= 0 (0 = no limit)")


@dataclass
class RewardComputationConfig:
    """``reward_computation``: how a finished trajectory becomes one reward, and how it meets the env rewards."""

    enable: bool = False
    """Score every finished trajectory with the computer below (needs ctx_manager.mode=condensed and the
    question environment, data.train_files). The reward sits on the last generated token of the trajectory's
    last turn: R_total = env_reward_weight x (sum of the env's turn rewards) + trajectory_reward_weight x R."""
    env_reward_weight: float = 1.0
    """Weight of the environment's per-turn rewards (format penalty included) when enable; 0 = the trajectory
    reward alone (seed 004's R)."""
    trajectory_reward_weight: float = 1.0
    """Weight of the computer's trajectory reward R when enable."""
    type: str = "grpo"
    """Registered reward computer name, or "package.module:ClassName"."""
    domain: str = "general"
    """How answers are checked: general (normalised exact match), math (numeric / LaTeX equivalence),
    coding (the answer is a Python program run against the row's tests in a sandbox)."""
    ground_truth_file: str | None = None
    """JSON or JSONL of ground truths keyed by question id; used when a row carries none."""
    format_validation: FormatValidationConfig = field(default_factory=FormatValidationConfig)
    """Format rules; a trajectory breaking one gets reward 0."""
    efficiency_scale: float = 1000.0
    """A correct trajectory earns efficiency_scale / max_context_length (1000: per thousand tokens, so a
    correct answer whose longest row is 500 tokens earns 2.0; 1.0 gives the seed's literal 1/L)."""
    num_workers: int = 2
    """Threads of BatchTrajectoryRewardComputer (each coding check is a sandboxed subprocess)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits of each coding sandbox run (wall_s, cpu_s, mem_mb, max_output_bytes, ...)."""

    def __post_init__(self):
        if isinstance(self.format_validation, dict):
            self.format_validation = FormatValidationConfig(**self.format_validation)
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxLimits(**self.sandbox)
        if self.domain not in DOMAINS:
            raise ValueError(f"reward_computation.domain = {self.domain!r} is not one of {list(DOMAINS)}; "
                             "set it to one of them")
        if not isinstance(self.efficiency_scale, (int, float)) or self.efficiency_scale <= 0:
            raise ValueError(f"reward_computation.efficiency_scale = {self.efficiency_scale!r} must be > 0")
        for name in ("env_reward_weight", "trajectory_reward_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"reward_computation.{name} = {value!r} must be a finite number >= 0")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"reward_computation.num_workers = {self.num_workers!r} must be an int >= 1")
