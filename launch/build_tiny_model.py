"""Build the tiny Qwen2-architecture model the CPU runs, tests and CI train.

    python -m launch.build_tiny_model --out models/tiny-qwen2 [--warmup-steps 300 --seed 0]

The result is an ordinary Hugging Face checkpoint (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) loaded like any other
model: ``AutoModelForCausalLM``, ``AutoTokenizer``,
``AutoModelForTokenClassification(num_labels=1)`` for a critic, and
``vllm.LLM(model=path)``. Nothing downstream special-cases it.

Steps:

1. Corpus: the environments' own text (instructions, legends, action
   descriptions, reset observations for a few dozen seeds and a few random
   steps per tag from ``config/envs.yaml``) plus the prompt strings of
   ``agent_trainer.common.prompts``.
2. Tokenizer: byte-level BPE trained on that corpus with Qwen2's
   pre-tokenizer, ChatML special tokens (``<|endoftext|>`` pad,
   ``<|im_start|>``, ``<|im_end|>`` eos) and Qwen2's chat template;
   ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are single
   (non-special) tokens so the reply format is cheap to learn.
3. Model: Qwen2ForCausalLM, head_dim 64 (vLLM's CPU attention rejects
   smaller heads), tied embeddings, float32.
4. Format warm-up: a short causal-LM fit on synthetic chat transcripts whose
   assistant turns are ``<think>..</think><answer>RANDOM valid action</answer>``,
   loss on assistant tokens only. Random (not expert) actions teach the reply
   format but not the task, so RL has something left to learn. Where the env
   notes its observation (``BaseEnv.note``: FrozenLake's ``Down: ice, Right:
   hole.``) the think is that note, so the model learns to copy what it reads;
   such tags get ``NOTED_SEEDS`` reset seeds, enough maps that the copy is
   learned rather than remembered.

Deterministic given ``--seed``. Building is idempotent: a complete model at
``--out`` is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from agent_trainer.common import prompts
from launch import reading_corpus

logger = logging.getLogger(__name__)

DEFAULT_OUT = "models/tiny-qwen2"
HEAD_DIM = 64  # vLLM CPU attention rejects head_dim 16; 64 is measured to work
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
FORMAT_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
NOTED_SEEDS = 512
"""Reset seeds of a tag whose env notes its observations (``BaseEnv.note``), and of a tag a user adds with
``--add-envs-config``: the copy is learned on that many maps rather than remembered."""
NOTED_STEPS = 6
"""With ``--note-answers``: random steps per episode of a noted tag, so a transcript may run as many turns as an
episode of make train's task and the note's answer is learned at every turn, not only at the first two."""
NOTED_MAX_LEN = 1024
"""With ``--note-answers``: the warm-up's longest transcript in tokens (512 otherwise), so those of the later turns
(up to about 900 tokens) are kept, not left out."""

# Qwen2.5-Instruct's ChatML template with its tool-calling format (``tools=`` in apply_chat_template,
# ``<tool_call>`` / ``<tool_response>`` blocks; agent_trainer/agents/tool_call.py), verbatim but for the
# default system message (Qwen2's). Without tools it renders exactly what Qwen2-Instruct's template does.
QWEN2_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == \"tool\" %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenizer split, so our tokenizer reloads identically as Qwen2Tokenizer.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_THINK_TEMPLATES = ["I will try {a}.", "Let me go {a}.", "{a} looks good.", "Try {a} now.", "Maybe {a}."]
_REQUIRED_FILES = ["config.json", "model.safetensors", "tokenizer.json", "build_info.json"]
# --size presets: same builder, tokenizer and warm-up, wider and deeper decoder (bench P2/P7 scaling).
SIZE_PRESETS = {
    "tiny": {"hidden_size": 128, "layers": 2, "kv_heads": 1, "intermediate_size": 384},
    "20m": {"hidden_size": 512, "layers": 6, "kv_heads": 1, "intermediate_size": 1536},
}


@dataclass
class EpisodeSample:
    """One reset of one env tag plus a few random steps: material for warm-up transcripts."""

    tag: str
    instruction: str
    """Instruction text of the first user turn (tag instruction, legend, action list)."""
    observations: list[str]
    """Observation after reset, then after each step in ``taken``."""
    choices: list[tuple[list[str], bool]]
    """Per observation still open for a reply: (action choices, from a discrete list?)."""
    taken: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    notes: list[str | None] = field(default_factory=list)
    """Per observation: the env's note of it (``BaseEnv.note``), the think of the reply to it; None: a template."""

    @property
    def noted(self) -> bool:
        """Whether the env notes its observations (its first one has a note)."""
        return bool(self.notes) and self.notes[0] is not None


@dataclass
class Corpus:
    """Text for the tokenizer and episodes for the warm-up."""

    texts: list[str]
    episodes: list[EpisodeSample]
    tags_used: list[str]
    tags_skipped: dict[str, str]
    source: str
    """"envs" or "prompts_only" (envs package or its config unavailable)."""


# --------------------------------------------------------------------------- corpus


def action_choices(description: str, observation: str) -> tuple[list[str], bool]:
    """Actions a random reply may take in this state, and whether they come from a list.

    Discrete envs describe their actions as a list ("Left | Down | Right | Up";
    TextWorld lists the commands available in the current state), so any
    entry is valid. Free-text envs (math, countdown, guess-a-number) describe
    the answer in prose; for them a number (else a word) from the observation is a
    well-formed, almost always wrong answer, which is what the warm-up wants.
    """
    if "|" in description:
        return [c.strip() for c in description.split("|") if c.strip()], True
    words = [w.strip(".,;:!?()[]{}'\"$") for w in observation.split()]
    words = [w for w in words if w and len(w) <= 20]
    # Answers to such tasks are mostly numbers; prefer the numbers on the page.
    return [w for w in words if any(ch.isdigit() for ch in w)] or words or ["0"], False


def _collect_tag(tag: str, tags: dict, n_seeds: int, n_steps: int, rng: random.Random,
                 noted_steps: int | None = None) -> tuple[list[str], list[EpisodeSample]]:
    """Text and episodes of one tag: instruction, legend, actions, reset/step observations (``noted_steps`` steps
    instead of ``n_steps`` where the env notes its observations, when given)."""
    from envs import make_env

    env = make_env(tag, tags=tags)
    try:
        texts, episodes = [tags[tag].env_instruction, env.legend()], []
        seed = 0
        while seed < n_seeds or (episodes and episodes[0].noted and seed < NOTED_SEEDS):
            obs = env.reset(seed=seed)
            seed += 1
            description = env.action_description()
            # As the env-state manager builds it: tag instruction, then legend, then actions.
            instruction = "\n".join(
                p for p in [tags[tag].env_instruction.strip(), env.legend(), f"Actions: {description}"] if p
            )
            ep = EpisodeSample(tag, instruction, [obs], [action_choices(description, obs)], notes=[env.note()])
            texts += [description, obs]
            for _ in range(noted_steps if noted_steps and ep.noted else n_steps):
                action = rng.choice(ep.choices[-1][0])
                obs, reward, done, _ = env.step(action)
                ep.taken.append(action)
                ep.rewards.append(float(reward))
                ep.observations.append(obs)
                ep.notes.append(env.note())
                texts.append(obs)
                if done:  # no further turn: ``choices`` stays one shorter than ``observations``
                    break
                description = env.action_description()
                texts.append(description)
                ep.choices.append(action_choices(description, obs))
            episodes.append(ep)
        return texts, episodes
    finally:
        env.close()


def _prompt_texts() -> list[str]:
    """Every fixed string of ``agent_trainer.common.prompts`` (system prompt, format lines)."""
    return [
        prompts.SYSTEM_PROMPT, prompts.THINK_ANSWER_FORMAT, prompts.ANSWER_ONLY_FORMAT,
        prompts.next_user_message("", 0.0), prompts.next_user_message("", 1.0),
        "system\nuser\nassistant\nReward: -0.1 0.5 1 Observation:",
    ]


def collect_corpus(envs_config: str | Path, n_seeds: int = 32, n_steps: int = 3, seed: int = 0,
                   add_envs_configs: tuple[str | Path, ...] = (), noted_steps: int | None = None) -> Corpus:
    """Gather text and warm-up episodes from every tag in ``envs_config`` and then in ``add_envs_configs``
    (a user's tags files: their tags add to the corpus; a tag named in two files is refused).

    A tag whose optional dependency is missing (ImportError) is skipped and
    logged; any other error (a wrong config path included) propagates.
    When the ``envs`` package cannot be imported the corpus is the prompt
    strings only, with a warning (the model then has seen no environment text).
    """
    rng = random.Random(seed)
    texts = _prompt_texts()
    try:
        from envs import load_env_tags
    except ImportError as exc:
        logger.warning("environments unavailable (%s): tiny model built from prompt strings only", exc)
        placeholder = EpisodeSample("none", "Solve the task.", ["(no environment available)"],
                                    [(["Left", "Right", "Up", "Down"], True)])
        return Corpus(texts, [placeholder], [], {}, "prompts_only")
    tags = load_env_tags(envs_config)
    shipped = set(tags)
    for extra in add_envs_configs:
        added = load_env_tags(extra)
        if clash := sorted(set(added) & set(tags)):
            raise ValueError(f"--add-envs-config {extra}: tags {clash} are already in {envs_config} or an earlier "
                             "file; rename them in your tags file (the corpus keeps one tag per name)")
        tags.update(added)
    episodes, used, skipped = [], [], {}
    for tag in tags:
        try:
            # A user's added tag gets as many maps as a noted one: that build is for their env.
            tag_seeds = n_seeds if tag in shipped else max(n_seeds, NOTED_SEEDS)
            tag_texts, tag_episodes = _collect_tag(tag, tags, tag_seeds, n_steps, rng, noted_steps)
        except ImportError as exc:
            skipped[tag] = " ".join(str(exc).split())  # one line, however many the env's message has
            logger.warning("skipping env tag %s: missing optional dependency (%s)", tag, skipped[tag])
            continue
        texts += tag_texts
        episodes += tag_episodes
        used.append(tag)
    if not episodes:
        raise ValueError(f"no env tag in {envs_config} could be made (skipped: {skipped}); install the env extras")
    logger.info("corpus: %d texts, %d episodes from tags %s", len(texts), len(episodes), used)
    return Corpus(texts, episodes, used, skipped, "envs")


# --------------------------------------------------------------------------- tokenizer and model


def train_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as transformers' ``Qwen2Tokenizer``.

    The BPE is trained with Qwen2's own normalizer / pre-tokenizer / decoder,
    then its vocab and merges are handed to ``Qwen2Tokenizer`` (in
    transformers 5 the tokenizers-backed fast class), so the saved
    ``tokenizer_config.json`` names the class real Qwen2 checkpoints use.
    Raises RuntimeError if the wrapped tokenizer encodes any text differently
    from the trained one.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Format tags become added tokens below; keep BPE from spending merges on their pieces.
    cleaned = []
    for text in texts:
        for tag in FORMAT_TOKENS:
            text = text.replace(tag, " ")
        cleaned.append(text)
    bpe.train_from_iterator(cleaned, trainer)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # Not special: they must survive decode(skip_special_tokens=True) as text.
    format_tokens = [AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS]
    bpe.add_tokens(format_tokens)

    model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
        bos_token=None, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],  # as in Qwen2's tokenizer_config
        chat_template=QWEN2_CHAT_TEMPLATE, model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(format_tokens)
    probe = texts + [_reply(["Left", "Up"], random.Random(0)) + EOS_TOKEN + "\n<|im_start|>user"]
    if any(tokenizer.encode(t) != bpe.encode(t).ids for t in probe):
        raise RuntimeError("Qwen2Tokenizer encodes differently from the trained BPE; check the pipeline")
    return tokenizer


def make_model(tokenizer, *, hidden_size: int = 128, layers: int = 2, kv_heads: int = 1,
               intermediate_size: int = 384, max_position_embeddings: int = 2048, seed: int = 0):
    """A randomly initialised float32 Qwen2ForCausalLM sized to ``tokenizer`` (head_dim 64)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    heads = hidden_size // HEAD_DIM
    if hidden_size % HEAD_DIM or heads % kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be a multiple of {HEAD_DIM} (vLLM CPU needs head_dim 64) "
            f"and kv_heads ({kv_heads}) must divide the {heads} attention heads; e.g. --hidden-size 128 --kv-heads 1"
        )
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # exactly the tokenizer: no untrained rows that decode to nothing
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # Only ids: sampling settings stay with the caller (vLLM and HF both read this file).
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    return model


# --------------------------------------------------------------------------- warm-up


def _reply(actions: list[str], rng: random.Random, note: str | None = None) -> str:
    """``<think>note or short text</think><answer>actions joined by ||</answer>``."""
    think = note if note is not None else rng.choice(_THINK_TEMPLATES).format(a=actions[0])
    return f"<think>{think}</think><answer>{' || '.join(actions)}</answer>"


def _note_items(note: str) -> list[tuple[str, str]]:
    """``Down: ice, Right: hole.`` -> [("Down", "ice"), ("Right", "hole")]."""
    items = [item.split(":", 1) for item in note.rstrip(".").split(",")]
    return [(name.strip(), word.strip()) for name, word in (item for item in items if len(item) == 2)]


@dataclass(frozen=True)
class NoteAnswers:
    """``--note-answers``: the answer a build gives after a note. It follows the note's first word (``ice`` in
    ``Down: ice, Right: hole.``) and is one of the actions the note does not name (Left and Up there): aimed at
    nothing, neither the goal nor a hole. The words seen in the build's notes, sorted, take those actions in
    turn from an offset the build's key draws, so neighbouring words (``hole`` and ``ice``) always answer
    differently and which word answers which action differs from build to build: the build teaches that the
    answer follows the note, never which answer is right."""

    key: str
    words: tuple[str, ...]
    """Every first word of the build's notes, sorted."""

    @classmethod
    def of(cls, key: str, notes: list[str]) -> NoteAnswers:
        return cls(key, tuple(sorted({items[0][1] for items in map(_note_items, notes) if items})))

    def answer(self, note: str, choices: list[str]) -> str | None:
        """The action after ``note``, or None where the note names no word this build saw."""
        items = _note_items(note)
        if not items or items[0][1] not in self.words:
            return None
        named = {name for name, _ in items}
        unnamed = [c for c in choices if c not in named] or list(choices)
        offset = int(hashlib.sha256(self.key.encode()).hexdigest(), 16) % len(unnamed)
        return unnamed[(offset + self.words.index(items[0][1])) % len(unnamed)]


def make_transcript(ep: EpisodeSample, rng: random.Random, note_answers: NoteAnswers | None = None) -> list[dict]:
    """A chat built with the rollout's own prompt functions, 1 or 2 turns; replies are random actions. With
    ``note_answers`` a noted episode runs 1 to all of its recorded turns and the last reply answers the note's
    action (:class:`NoteAnswers`); the earlier replies are the actions that produced the recorded observations
    (:func:`encode_transcript` trains the last reply only, the history is context)."""
    messages = [{"role": "system", "content": prompts.SYSTEM_PROMPT},
                {"role": "user", "content": prompts.first_user_message(ep.instruction, ep.observations[0])}]
    answering = note_answers is not None and ep.noted
    turns = rng.randrange(len(ep.choices)) if answering else int(len(ep.choices) > 1 and rng.random() < 0.5)
    for turn in range(turns):
        # An earlier turn: its reply is the action that produced the recorded next observation.
        messages.append({"role": "assistant", "content": _reply([ep.taken[turn]], rng, _note(ep, turn))})
        messages.append({"role": "user", "content": prompts.next_user_message(ep.observations[turn + 1],
                                                                             ep.rewards[turn])})
    choices, discrete = ep.choices[turns]
    note = _note(ep, turns)
    answer = note_answers.answer(note, choices) if answering and note is not None and discrete else None
    if answer is not None:
        actions = [answer]
    else:
        # Several actions per turn ("A || B") only where actions are names; "||" would corrupt a free-text answer.
        n_actions = 2 if discrete and rng.random() < 0.2 else 1
        actions = [rng.choice(choices) for _ in range(n_actions)]
    messages.append({"role": "assistant", "content": _reply(actions, rng, note)})
    return messages


def _note(ep: EpisodeSample, turn: int) -> str | None:
    return ep.notes[turn] if turn < len(ep.notes) else None


def encode_transcript(tokenizer, messages: list[dict], last_reply_only: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the ChatML transcript and a mask that is 1 on assistant content and its ``<|im_end|>`` (on the
    last reply's only with ``last_reply_only``: the earlier replies are context).

    Pieces are encoded separately; they split at special/added tokens or
    newlines, so the concatenation equals tokenizing the whole chat template
    output (tests check this).
    """
    ids, mask = [], []
    last = max((i for i, msg in enumerate(messages) if msg["role"] == "assistant"), default=-1)
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            trained = int(not last_reply_only or i == last)
            pieces = [("<|im_start|>assistant\n", 0), (msg["content"] + EOS_TOKEN, trained), ("\n", 0)]
        else:
            pieces = [(f"<|im_start|>{msg['role']}\n{msg['content']}{EOS_TOKEN}\n", 0)]
        for text, m in pieces:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [m] * len(piece)
    return ids, mask


def warmup(model, tokenizer, episodes: list[EpisodeSample], *, steps: int, seed: int = 0,
           batch_size: int = 8, lr: float = 5e-3, max_len: int = 512, reading_fraction: float = 0.0,
           max_transcripts: int = 2048, noted_weight: float = 1.0, note_answers: bool = False,
           on_step: Callable[[int], None] | None = None) -> tuple[float, set[str]]:
    """Causal-LM fit on synthetic transcripts, loss on assistant tokens only; returns the final loss and the
    reading exercises' prompts it trained on (for the probe to avoid).

    ``reading_fraction`` of the transcripts are reading exercises (``launch.reading_corpus``), the rest
    random-action env transcripts. The reported loss is the mean over the last 10 steps (one batch is noisy).
    At most ``max_transcripts`` distinct transcripts are drawn, each from a tag drawn at random, a tag whose env
    notes its observations (``BaseEnv.note``) ``noted_weight`` times as often as another. With ``note_answers``
    a noted transcript's last reply answers a fixed function of its note, keyed by ``seed`` (:class:`NoteAnswers`),
    and only that reply is trained.
    ``on_step(step)`` runs after each step (a probe during a pilot).
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n_pool = min(steps * batch_size, max_transcripts)
    n_reading = round(n_pool * reading_fraction)
    chats = reading_corpus.exercise_chats(n_reading, seed)
    seen = {chat[1]["content"] for chat in chats}
    by_tag: dict[str, list[EpisodeSample]] = {}
    for ep in episodes:
        by_tag.setdefault(ep.tag, []).append(ep)
    # A tag whose env notes its observations weighs noted_weight times the others.
    names = list(by_tag)
    weights = [noted_weight if by_tag[t][0].noted else 1.0 for t in names]
    answers = NoteAnswers.of(f"build-{seed}", [n for ep in episodes if ep.noted for n in ep.notes if n]) \
        if note_answers else None
    chats = [(chat, False) for chat in chats]
    for _ in range(n_pool - n_reading):
        ep = rng.choice(by_tag[rng.choices(names, weights)[0]])
        chats.append((make_transcript(ep, rng, answers), answers is not None and ep.noted))
    pool = []
    for chat, last_reply_only in chats:
        ids, mask = encode_transcript(tokenizer, chat, last_reply_only)
        if len(ids) <= max_len:
            pool.append((ids, mask))
    if len(pool) < batch_size:
        raise ValueError(f"only {len(pool)} warm-up transcripts fit max_len={max_len}; raise max_len")
    if len(pool) < len(chats):
        logger.info("warm-up: %d of %d transcripts are longer than max_len=%d and left out",
                    len(chats) - len(pool), len(chats), max_len)
    # Batches of neighbours in length order: little padding, which is most of the cost on CPU.
    pool.sort(key=lambda item: len(item[0]))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    model.train()
    losses = []
    for _ in range(steps):
        first = rng.randrange(len(pool) - batch_size + 1)
        batch = pool[first : first + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        trained = torch.zeros((batch_size, width), dtype=torch.bool)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            trained[row, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
        # Right padding under causal attention: real tokens never see the padding after them,
        # so no attention mask is needed (and the unmasked causal kernel is faster).
        hidden = model.model(input_ids=input_ids).last_hidden_state
        # Position t predicts token t+1. Apply the LM head only where the next token is trained
        # (~10% of positions): the head is a third of the FLOPs of this model.
        select = trained[:, 1:]
        logits = model.lm_head(hidden[:, :-1][select])
        loss = torch.nn.functional.cross_entropy(logits.float(), input_ids[:, 1:][select])
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(len(losses))
    model.eval()
    return sum(losses[-10:]) / len(losses[-10:]), seen


@torch.no_grad()
def _replies(model, tokenizer, user_messages: list[str], *, sample: bool, max_new_tokens: int) -> list[str]:
    """The model's first-turn reply to each user message (system prompt first), decoded without special tokens:
    sampled at temperature 1 (no top-k/top-p) or greedy, in one left-padded batch."""
    prompt_ids = [tokenizer.apply_chat_template([{"role": "system", "content": prompts.SYSTEM_PROMPT},
                                                 {"role": "user", "content": text}],
                                                add_generation_prompt=True, return_dict=False)
                  for text in user_messages]
    width = max(map(len, prompt_ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])  # left padding
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sampling)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def format_ok_rate(model, tokenizer, episodes: list[EpisodeSample], *, n_samples: int = 32,
                   seed: int = 0, max_new_tokens: int = 48) -> float:
    """Fraction of temperature-1 samples (first turn) that ``prompts.parse_response`` accepts."""
    rng = random.Random(seed + 1)
    torch.manual_seed(seed + 1)
    messages = []
    for _ in range(n_samples):
        ep = rng.choice(episodes)
        messages.append(prompts.first_user_message(ep.instruction, ep.observations[0]))
    replies = _replies(model, tokenizer, messages, sample=True, max_new_tokens=max_new_tokens)
    return sum(prompts.parse_response(r).format_ok for r in replies) / n_samples


def reading_accuracy(model, tokenizer, n: int = 128, seed: int = 0, seen: set[str] | None = None,
                     batch_size: int = 32) -> float:
    """The reading probe: greedy exact-match accuracy on ``n`` held-out reading exercises
    (``launch.reading_corpus``; a prompt in ``seen`` is never asked)."""
    pairs = reading_corpus.held_out_exercises(n, seed, seen or set())
    right = 0
    for first in range(0, n, batch_size):
        batch = pairs[first:first + batch_size]
        replies = _replies(model, tokenizer, [prompt for prompt, _ in batch], sample=False, max_new_tokens=12)
        right += sum(prompts.parse_response(reply, enable_think=False).answer == answer
                     for (_, answer), reply in zip(batch, replies))
    return right / n


# --------------------------------------------------------------------------- build


@contextlib.contextmanager
def _torch_threads(n: int):
    """Context manager: torch intra-op threads set to ``n``, restored on exit."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move a finished build into place; a complete model a concurrent build left there wins unless ``force``."""
    if out.exists():
        if is_complete(out) and not force:
            return
        shutil.rmtree(out)
    tmp.rename(out)


def is_complete(out_dir: str | Path) -> bool:
    """True when ``out_dir`` holds a finished build (``build_info.json`` is written last)."""
    return all((Path(out_dir) / name).exists() for name in _REQUIRED_FILES)


def build_tiny_model(out_dir: str | Path = DEFAULT_OUT, *, vocab_size: int = 3000, hidden_size: int = 128,
                     layers: int = 2, kv_heads: int = 1, intermediate_size: int = 384,
                     max_position_embeddings: int = 2048, warmup_steps: int = 300, batch_size: int = 8,
                     lr: float = 5e-3, seed: int = 0, envs_config: str | Path = "config/envs.yaml",
                     corpus_seeds: int = 32, format_samples: int = 32, threads: int = 1,
                     reading_fraction: float = 0.0, reading_samples: int = 128, noted_weight: float = 1.0,
                     note_answers: bool = False, force: bool = False,
                     add_envs_configs: tuple[str | Path, ...] = (), tokenizer_from: str | Path | None = None) -> Path:
    """Build (or reuse) the tiny model at ``out_dir`` and return its path.

    The build goes to a temporary sibling directory that is renamed into
    place at the end, so an interrupted or concurrent build never leaves a
    half-written model at ``out_dir``. ``threads`` sets torch's thread count
    for the build (restored afterwards). ``tokenizer_from``: a model folder whose tokenizer the build takes
    instead of training its own on the corpus (the tokenizer depends on the corpus, which ``note_answers`` and
    the seed change), so the model can score another build's token ids (a distillation teacher of that build).
    """
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if is_complete(out) and not force:
        logger.info("%s already holds a complete model; skipping (use --force to rebuild)", out)
        return out
    # One thread by default: on 2 shared cores, 2 threads made a warm-up step 11x slower
    # (1.3 s vs 0.12 s) while other workers ran (OpenMP spin-waits). A fixed count also
    # fixes the float reduction order, so a seed reproduces the same bytes.
    with _torch_threads(threads):
        start = time.monotonic()
        corpus = collect_corpus(envs_config, n_seeds=corpus_seeds, seed=seed, add_envs_configs=add_envs_configs,
                                noted_steps=NOTED_STEPS if note_answers else None)
        tmp = out.parent / f".{out.name}.building-{time.time_ns()}"
        tmp.mkdir(parents=True)
        try:
            texts = corpus.texts + (reading_corpus.corpus_texts(seed) if reading_fraction > 0 else [])
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_from) if tokenizer_from else train_tokenizer(
                texts, vocab_size)
            tokenizer.save_pretrained(tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp)  # exactly what every consumer will load

            model = make_model(tokenizer, hidden_size=hidden_size, layers=layers, kv_heads=kv_heads,
                               intermediate_size=intermediate_size,
                               max_position_embeddings=max_position_embeddings, seed=seed)
            loss, seen = None, set()
            if warmup_steps > 0:
                loss, seen = warmup(model, tokenizer, corpus.episodes, steps=warmup_steps, seed=seed,
                                    batch_size=batch_size, lr=lr, reading_fraction=reading_fraction,
                                    noted_weight=noted_weight, note_answers=note_answers,
                                    max_len=NOTED_MAX_LEN if note_answers else 512)
            rate = format_ok_rate(model, tokenizer, corpus.episodes, n_samples=format_samples, seed=seed)
            reading = reading_accuracy(model, tokenizer, n=reading_samples, seed=seed, seen=seen)
            model.save_pretrained(tmp, safe_serialization=True)
            info = {
                "seed": seed, "vocab_size": len(tokenizer), "bpe_vocab_size": vocab_size,
                "hidden_size": hidden_size, "layers": layers, "kv_heads": kv_heads,
                "intermediate_size": intermediate_size,
                "n_params": sum(p.numel() for p in model.parameters()),
                "warmup_steps": warmup_steps, "batch_size": batch_size, "lr": lr,
                "final_warmup_loss": loss, "format_ok_rate": rate, "format_samples": format_samples,
                "noted_weight": noted_weight, "note_answers": note_answers, "reading_fraction": reading_fraction,
                "reading_accuracy": reading, "reading_samples": reading_samples,
                "tokenizer_from": None if tokenizer_from is None else str(tokenizer_from),
                "corpus": {"source": corpus.source, "tags_used": corpus.tags_used,
                           "noted_tags": sorted({ep.tag for ep in corpus.episodes if ep.noted}),
                           "tags_skipped": corpus.tags_skipped, "n_texts": len(corpus.texts),
                           "n_episodes": len(corpus.episodes)},
                "build_seconds": round(time.monotonic() - start, 2),
            }
            (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
            _publish(tmp, out, force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        loss_text = "skipped" if loss is None else f"{loss:.4f}"
        print(f"built {out}: {info['n_params']:,} params, vocab {info['vocab_size']}, "
              f"final warm-up loss {loss_text}, format_ok {rate:.2f} over {format_samples} samples, "
              f"{info['build_seconds']} s")
        return out


def build_reward_model(policy_dir: str | Path, out_dir: str | Path, *, seed: int = 0) -> Path:
    """A tiny reward model: the policy's backbone under a seeded score head (``AutoModelForSequenceClassification``).

    One label, the head drawn from N(0, 1/hidden_size) with ``seed`` (so different texts get visibly
    different scores), ``pad_token_id`` set so the score is read at the last non-pad token. It is
    untrained: it scores text deterministically, which is what tests of the reward-model path need.
    Idempotent: a folder already holding ``config.json`` is kept.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) / model.config.hidden_size ** 0.5)
    tmp = out.parent / f".{out.name}.building-{time.time_ns()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _publish(tmp, out, force=False)
    print(f"built reward model {out} from {policy_dir}")
    return out


def main(argv: list[str] | None = None) -> Path:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (HF format)")
    p.add_argument("--vocab-size", type=int, default=3000, help="BPE target vocab size (before added tokens)")
    p.add_argument("--hidden-size", type=int, default=128, help="multiple of 64; heads = hidden_size / 64")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--kv-heads", type=int, default=1, help="key/value heads (GQA); must divide the heads")
    p.add_argument("--intermediate-size", type=int, default=384, help="MLP width")
    p.add_argument("--max-position-embeddings", type=int, default=2048, help="context length")
    p.add_argument("--warmup-steps", type=int, default=300, help="format warm-up steps; 0 keeps random init")
    p.add_argument("--noted-weight", type=float, default=1.0,
                   help="how much more often a tag whose env notes its observations is drawn for the warm-up (make "
                        "train's model: 16, with 800 steps, so the copy of the note forms; docs/tiny_model.md)")
    p.add_argument("--note-answers", action="store_true",
                   help="a noted transcript runs up to its episode's turns and its last reply answers an action "
                        "the note's first word and the build's seed decide, aimed at nothing, so the answer "
                        "learns to look at the note (docs/tiny_model.md)")
    p.add_argument("--batch-size", type=int, default=8, help="warm-up batch size (transcripts)")
    p.add_argument("--lr", type=float, default=5e-3, help="warm-up peak learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for corpus, init, warm-up and sampling")
    p.add_argument("--envs-config", default="config/envs.yaml", help="env tags to take text from")
    p.add_argument("--add-envs-config", action="append", default=[], metavar="FILE",
                   help="a tags file whose tags are added to --envs-config's (repeatable; your env's module must be "
                        "importable): the model then knows your env's words too")
    p.add_argument("--corpus-seeds", type=int, default=32, help="reset seeds per env tag")
    p.add_argument("--format-samples", type=int, default=32, help="samples for the format_ok rate")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the build (1 is fastest on shared cores)")
    p.add_argument("--reading-fraction", type=float, default=0.0,
                   help="share of warm-up transcripts that are reading exercises (launch/reading_corpus.py)")
    p.add_argument("--reading-samples", type=int, default=128,
                   help="held-out reading exercises of the probe (build_info.json: reading_accuracy)")
    p.add_argument("--tokenizer-from", default=None, metavar="MODEL_DIR",
                   help="take this model's tokenizer instead of training one on the corpus (a teacher of that model)")
    p.add_argument("--force", action="store_true", help="rebuild even when --out holds a complete model")
    p.add_argument("--reward-model-out", default="",
                   help="also build a tiny reward model (the policy's backbone + a score head) at this path")
    p.add_argument("--size", choices=sorted(SIZE_PRESETS), default=None,
                   help="preset shape (tiny: 0.6M params, the default shape; 20m: ~19M params for scaling "
                        "benchmarks); explicit --hidden-size/--layers/--kv-heads/--intermediate-size still win")
    preset, _ = p.parse_known_args(argv)
    p.set_defaults(**SIZE_PRESETS.get(preset.size, {}))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = build_tiny_model(
        a.out, vocab_size=a.vocab_size, hidden_size=a.hidden_size, layers=a.layers, kv_heads=a.kv_heads,
        intermediate_size=a.intermediate_size, max_position_embeddings=a.max_position_embeddings,
        warmup_steps=a.warmup_steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
        envs_config=a.envs_config, corpus_seeds=a.corpus_seeds, format_samples=a.format_samples,
        threads=a.threads, reading_fraction=a.reading_fraction, reading_samples=a.reading_samples,
        noted_weight=a.noted_weight, note_answers=a.note_answers, force=a.force, tokenizer_from=a.tokenizer_from,
        add_envs_configs=tuple(a.add_envs_config),
    )
    if a.reward_model_out:
        build_reward_model(out, a.reward_model_out, seed=a.seed)
    return out


if __name__ == "__main__":
    main()
