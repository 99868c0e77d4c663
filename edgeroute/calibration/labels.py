"""Per-position labels on the quantized bundle, in shards.

For each prompt the LLM writes its greedy answer (exactly what ``full`` decodes). Then, at
prefill speed, the SLM runs teacher-forced over prompt + answer and the n-gram drafter looks
up every answer prefix; each answer position keeps the light paths' tokens and features and
two labels per light path:

- ``token``: the light token differs from the LLM's;
- ``path`` (SLM, on a sample of divergent positions): R2R's refinement. The LLM continues
  from the light token for ``path_window`` tokens; if that continuation rejoins its own answer
  (``rejoin`` consecutive tokens equal, at most ``max_shift`` positions apart) the difference
  is neutral (a synonym, a reordering), otherwise divergent.

Shards are independent units of work with stable ids (the hash of the bundle's weights, the
settings and the shard's prompts): one ``.npz`` per shard, written to a temporary name and
renamed, so a killed run resumes where it stopped and a resumed run equals an uninterrupted
one. The shards run one after another here; a cluster executor can map ``label_shard`` over
``plan_shards`` instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgeroute.bundle import CALIBRATION_DIR
from edgeroute.calibration.prompts import TASKS, CalibrationPrompt
from edgeroute.runtime.drafters import NgramDrafter
from edgeroute.runtime.engine import Engine
from edgeroute.runtime.model import OrtModel
from edgeroute.runtime.routers import slm_features
from edgeroute.runtime.sampling import softmax

Progress = Callable[[str, int, int], None]
UNCHECKED, NEUTRAL, DIVERGENT = -1, 0, 1


@dataclass(frozen=True)
class LabelSettings:
    max_answer_tokens: int = 40
    shard_size: int = 8
    path_window: int = 8
    rejoin: int = 3
    max_shift: int = 2
    path_checks: int = 3  # divergent SLM positions per prompt that get the path-following check


@dataclass(frozen=True)
class Shard:
    id: str
    prompts: tuple[CalibrationPrompt, ...]


def bundle_identity(engine: Engine) -> str:
    """The hash of the bundle's model files (a new calibration section does not change it)."""
    files = {rel: meta["sha256"] for rel, meta in engine.bundle.manifest["files"].items()
             if not rel.startswith(f"{CALIBRATION_DIR}/")}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def plan_shards(engine: Engine, prompts: list[CalibrationPrompt], settings: LabelSettings) -> list[Shard]:
    identity = bundle_identity(engine)
    shards = []
    for start in range(0, len(prompts), settings.shard_size):
        chunk = tuple(prompts[start:start + settings.shard_size])
        key = json.dumps([identity, asdict(settings), [asdict(p) for p in chunk]], sort_keys=True)
        shards.append(Shard(hashlib.sha256(key.encode()).hexdigest()[:16], chunk))
    return shards


def greedy_answer(llm: OrtModel, ids: list[int], limit: int, eos: set[int]):
    """The LLM's greedy answer (as ``full`` decodes it) and the cache that produced it."""
    cache = llm.new_cache()
    logits = llm.forward(cache, ids)
    answer = []
    while True:
        token = int(np.argmax(logits))
        answer.append(token)
        if token in eos or len(answer) >= limit:
            return answer, cache
        logits = llm.forward(cache, [token])


def rejoins(alternative: list[int], reference: list[int], rejoin: int, max_shift: int) -> bool:
    """Does ``alternative`` reach ``rejoin`` consecutive tokens of ``reference`` at most
    ``max_shift`` positions from where they stand in it? A reference shorter than ``rejoin``
    must be the alternative's start."""
    if len(reference) < rejoin:
        return alternative[:len(reference)] == reference
    for a in range(len(alternative) - rejoin + 1):
        for b in range(max(0, a - max_shift), min(len(reference) - rejoin, a + max_shift) + 1):
            if alternative[a:a + rejoin] == reference[b:b + rejoin]:
                return True
    return False


def follow_path(llm: OrtModel, cache, start: int, light_token: int, window: int, eos: set[int]) -> list[int]:
    """The LLM's greedy continuation after ``light_token`` placed at ``start`` (the cache keeps
    every row before ``start``; rows from it on are overwritten)."""
    cache.truncate(start)
    logits = llm.forward(cache, [light_token])
    tokens = []
    while len(tokens) < window:
        token = int(np.argmax(logits))
        tokens.append(token)
        if token in eos or len(tokens) == window:
            break
        logits = llm.forward(cache, [token])
    return tokens


def label_prompt(engine: Engine, prompt: CalibrationPrompt, settings: LabelSettings) -> dict[str, np.ndarray]:
    ids = engine.encode_prompt([{"role": "user", "content": prompt.content}])
    answer, cache = greedy_answer(engine.llm, ids, settings.max_answer_tokens, engine.eos_ids)
    n, p = len(answer), len(ids)
    sequence = ids + answer
    slm = engine.slm
    hidden = slm.hidden_states(slm.new_cache(p + n), sequence[:-1])[p - 1:]
    probabilities = softmax(slm.head(hidden))
    slm_tokens = probabilities.argmax(-1)
    drafter = NgramDrafter()
    ngram = [drafter.propose(sequence[:p + j], 1) for j in range(n)]
    path = np.full(n, UNCHECKED, np.int8)
    divergent = np.flatnonzero(slm_tokens != np.asarray(answer))
    if divergent.size:
        sample = divergent[np.unique(np.linspace(0, divergent.size - 1, settings.path_checks).astype(int))]
        for j in sorted(sample.tolist(), reverse=True):  # later positions first: earlier cache rows stay valid
            alternative = follow_path(engine.llm, cache, p + j, int(slm_tokens[j]), settings.path_window,
                                      engine.eos_ids)
            reference = answer[j + 1:j + 1 + settings.path_window + settings.max_shift]
            path[j] = NEUTRAL if rejoins(alternative, reference, settings.rejoin, settings.max_shift) else DIVERGENT
    return {
        "task": np.full(n, TASKS.index(prompt.task), np.int8),
        "position": np.arange(n, dtype=np.int32),
        "llm_token": np.asarray(answer, np.int64),
        "slm_token": slm_tokens.astype(np.int64),
        "slm_features": np.stack([slm_features(h, q) for h, q in zip(hidden, probabilities, strict=True)]
                                 ).astype(np.float16),
        "slm_path": path,
        "ngram_token": np.asarray([d.tokens[0] if d.tokens else -1 for d in ngram], np.int64),
        "ngram_length": np.asarray([d.match_length for d in ngram], np.int32),
        "ngram_count": np.asarray([d.match_count for d in ngram], np.int32),
    }


def label_shard(engine: Engine, shard: Shard, settings: LabelSettings, directory: Path,
                progress: Progress | None = None) -> Path:
    """Label one shard into ``directory/<id>.npz`` (atomically); an existing file is kept."""
    target = directory / f"{shard.id}.npz"
    if target.is_file():
        return target
    parts = []
    for done, prompt in enumerate(shard.prompts, 1):
        parts.append(label_prompt(engine, prompt, settings))
        if progress is not None:
            progress("prompts", done, len(shard.prompts))
    arrays = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    arrays["prompt"] = np.concatenate([np.full(len(part["position"]), i, np.int32) for i, part in enumerate(parts)])
    arrays["prompt_ids"] = np.asarray([p.id for p in shard.prompts])
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{shard.id}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


@dataclass
class Labels:
    """Every labelled position of a prompt set; ``prompt`` indexes ``prompt_ids``."""

    arrays: dict[str, np.ndarray]
    prompt_ids: list[str]

    def __len__(self) -> int:
        return len(self.arrays["position"])

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def subset(self, mask: np.ndarray) -> dict[str, np.ndarray]:
        return {key: value[mask] for key, value in self.arrays.items()}


def load_labels(paths: list[Path]) -> Labels:
    arrays: dict[str, list[np.ndarray]] = {}
    prompt_ids: list[str] = []
    for path in paths:
        with np.load(path) as data:
            for key in data.files:
                if key == "prompt_ids":
                    continue
                value = data[key] + len(prompt_ids) if key == "prompt" else data[key]
                arrays.setdefault(key, []).append(value)
            prompt_ids.extend(str(i) for i in data["prompt_ids"])
    return Labels({key: np.concatenate(parts) for key, parts in arrays.items()}, prompt_ids)


def label_prompts(engine: Engine, prompts: list[CalibrationPrompt], settings: LabelSettings, directory: Path,
                  progress: Progress | None = None) -> Labels:
    """Label every shard not yet on disk, then load them all (in prompt order)."""
    shards = plan_shards(engine, prompts, settings)
    paths = []
    for done, shard in enumerate(shards):
        if progress is not None:
            progress("label shards", done, len(shards))
        paths.append(label_shard(engine, shard, settings, directory, progress))
    if progress is not None:
        progress("label shards", len(shards), len(shards))
    return load_labels(paths)
