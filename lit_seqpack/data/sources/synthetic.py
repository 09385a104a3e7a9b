"""The embedded default data: a deterministic synthetic instruction-tuning task generated in code.

Nothing is downloaded or stored: sample ``i`` is a pure function of ``(config, i)``. A sample is a
prompt (a task token and ``n`` random payload tokens) followed by the response, a deterministic
transformation of the payload that a small causal LM learns from context; the loss covers the
response only::

    input_ids  BOS  TASK  x1   x2  ...  xn   SEP  |  y1  y2  ...  yn  EOS
    labels     -100 -100  -100 -100 ... -100 -100 |  y1  y2  ...  yn  EOS
               '----------- prompt: n + 3 -------'   '-- response: n + 1 --'

A sample therefore has ``2 n + 4`` tokens (always even) and ``n + 1`` loss tokens. Token ids:

==========  =====================================================================
id          meaning
==========  =====================================================================
0           ``PAD_ID`` (never produced inside a sample; the collators pad with it)
1, 2, 3     ``BOS_ID``, ``EOS_ID``, ``SEP_ID``
4 .. 8      task tokens, ``TASK_TOKEN_IDS``: copy, reverse, shift, permute, sort
9 .. V-1    payload (``FIRST_PAYLOAD_ID`` up to ``vocab_size - 1``)
==========  =====================================================================

Tasks, with payload offsets ``p = x - FIRST_PAYLOAD_ID`` in ``[0, P)`` and ``P = vocab_size - 9``:
``copy`` y = x; ``reverse`` y = x reversed; ``shift`` p -> (p + 1) mod P; ``permute`` p -> perm[p]
with a permutation fixed by ``vocab_size`` alone (so splits with different seeds share the task);
``sort`` y = x sorted ascending.

Lengths are drawn per index from a counter-based hash, vectorised, so ``dataset.lengths`` for a
million samples costs milliseconds and no token is generated until a sample is read.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
import torch

from lit_seqpack._hashing import hashed_uniform
from lit_seqpack.batch import IGNORE_INDEX

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "FIRST_PAYLOAD_ID",
    "LENGTH_DISTRIBUTIONS",
    "PAD_ID",
    "SEP_ID",
    "SYNTHETIC_TASKS",
    "TASK_TOKEN_IDS",
    "SyntheticInstructionDataset",
    "SyntheticTaskConfig",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
SYNTHETIC_TASKS: tuple[str, ...] = ("copy", "reverse", "shift", "permute", "sort")
TASK_TOKEN_IDS: dict[str, int] = {task: 4 + i for i, task in enumerate(SYNTHETIC_TASKS)}
FIRST_PAYLOAD_ID = 4 + len(SYNTHETIC_TASKS)
_TASK_OF_TOKEN = {token: task for task, token in TASK_TOKEN_IDS.items()}
LENGTH_DISTRIBUTIONS: tuple[str, ...] = ("lognormal", "power_law", "uniform")
_OVERHEAD = 4  # BOS, TASK, SEP, EOS
_PERMUTATION_SEED = 0x5E9A
_GENERATOR_VERSION = 1  # bump when the generated samples change, so that cached lengths are invalidated
_STREAM_NORMAL_A, _STREAM_NORMAL_B, _STREAM_TASK = 1, 2, 3


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticTaskConfig:
    """Configuration of :class:`SyntheticInstructionDataset`.

    Args:
        num_samples: number of samples (indices ``0 .. num_samples - 1``).
        vocab_size: vocabulary size, including the 9 reserved ids; at least ``FIRST_PAYLOAD_ID + 2``.
        length_distribution: ``"lognormal"`` (median ``median_length``, log-std ``sigma``),
            ``"power_law"`` (Pareto tail with exponent ``alpha`` and median ``median_length``) or
            ``"uniform"`` (between ``min_length`` and ``max_length``; ``median_length`` unused).
        median_length: median sample length in tokens (prompt + response).
        sigma: log-standard deviation of the lognormal distribution.
        alpha: tail exponent of the power law (smaller is heavier).
        min_length: shortest sample; draws below are clipped up. At least 6 (one payload token).
        max_length: longest sample; draws above are clipped down.
        tasks: the task types to mix, a subset of ``SYNTHETIC_TASKS``.
        seed: base seed; sample ``i`` depends only on ``(seed, i)`` and the other fields.
    """

    num_samples: int = 10_000
    vocab_size: int = 256
    length_distribution: str = "lognormal"
    median_length: int = 128
    sigma: float = 1.0
    alpha: float = 1.5
    min_length: int = 8
    max_length: int = 2048
    tasks: tuple[str, ...] = ("copy", "reverse", "shift", "permute")
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        lengths_ok = self.min_length <= self.median_length <= self.max_length
        rules = [
            (self.num_samples >= 1, "num_samples", "must be >= 1"),
            (
                self.vocab_size >= FIRST_PAYLOAD_ID + 2,
                "vocab_size",
                f"must be >= {FIRST_PAYLOAD_ID + 2} (ids 0.."
                f"{FIRST_PAYLOAD_ID - 1} are reserved and at least 2 payload ids are needed)",
            ),
            (
                self.length_distribution in LENGTH_DISTRIBUTIONS,
                "length_distribution",
                f"must be one of {LENGTH_DISTRIBUTIONS}",
            ),
            (self.min_length >= _OVERHEAD + 2, "min_length", "must be >= 6 (BOS, task, SEP, EOS and 2 x 1 payload)"),
            (
                _min_payload(self.min_length) <= _max_payload(self.max_length),
                "max_length",
                f"must allow an even length >= min_length={self.min_length} (samples have 2n + 4 tokens)",
            ),
            (
                self.length_distribution == "uniform" or lengths_ok,
                "median_length",
                f"must lie in [min_length={self.min_length}, max_length={self.max_length}]",
            ),
            (self.sigma > 0, "sigma", "must be > 0"),
            (self.alpha > 0, "alpha", "must be > 0"),
            (
                0 < len(set(self.tasks)) == len(self.tasks) and set(self.tasks) <= set(SYNTHETIC_TASKS),
                "tasks",
                f"must be distinct names from {SYNTHETIC_TASKS}",
            ),
            (isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed", "must be an int in [0, 2**63)"),
        ]
        for ok, setting, rule in rules:
            if not ok:
                raise ValueError(f"{setting}={getattr(self, setting)!r} {rule}")


def _min_payload(min_length: int) -> int:
    return -((_OVERHEAD - min_length) // 2)  # ceil((min_length - 4) / 2)


def _max_payload(max_length: int) -> int:
    return (max_length - _OVERHEAD) // 2


class SyntheticInstructionDataset(torch.utils.data.Dataset):
    """Map-style synthetic instruction-tuning data with heavy-tailed lengths, generated lazily per index.

    The arguments are the fields of :class:`SyntheticTaskConfig` (validated there; kept as ``config``).
    ``dataset[i]`` returns ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}`` with the prompt
    masked by -100.

    Example:
        >>> ds = SyntheticInstructionDataset(num_samples=1000, median_length=64, seed=3)
        >>> int(ds.lengths[7]) == len(ds[7]["input_ids"])
        True
        >>> int(ds.loss_tokens[7]) == (ds[7]["labels"][1:] != -100).sum().item()
        True
    """

    def __init__(
        self,
        *,
        num_samples: int = 10_000,
        vocab_size: int = 256,
        length_distribution: str = "lognormal",
        median_length: int = 128,
        sigma: float = 1.0,
        alpha: float = 1.5,
        min_length: int = 8,
        max_length: int = 2048,
        tasks: Sequence[str] = ("copy", "reverse", "shift", "permute"),
        seed: int = 0,
    ) -> None:
        self.config = SyntheticTaskConfig(
            num_samples=num_samples,
            vocab_size=vocab_size,
            length_distribution=length_distribution,
            median_length=median_length,
            sigma=sigma,
            alpha=alpha,
            min_length=min_length,
            max_length=max_length,
            tasks=tuple(tasks),
            seed=seed,
        )
        self._lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return self.config.num_samples

    def payload_lengths(self, indices: np.ndarray) -> np.ndarray:
        """Number of payload tokens ``n`` of each sample, vectorised (no token is generated)."""
        cfg = self.config
        idx = np.asarray(indices, dtype=np.uint64)
        target = _target_lengths(cfg, idx)
        n = np.floor((target - _OVERHEAD) / 2)
        return np.clip(n, _min_payload(cfg.min_length), _max_payload(cfg.max_length)).astype(np.int64)

    def task_ids(self, indices: np.ndarray) -> np.ndarray:
        """Position in ``config.tasks`` of the task of each sample, vectorised."""
        u = hashed_uniform(self.config.seed, np.asarray(indices, dtype=np.uint64), _STREAM_TASK)
        return np.minimum((u * len(self.config.tasks)).astype(np.int64), len(self.config.tasks) - 1)

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every sample (``2 n + 4``), computed once, vectorised, read-only."""
        if self._lengths is None:
            lengths = 2 * self.payload_lengths(np.arange(len(self))) + _OVERHEAD
            lengths.flags.writeable = False
            self._lengths = lengths
        return self._lengths

    @property
    def loss_tokens(self) -> np.ndarray:
        """Loss tokens of every sample: the response and EOS, ``n + 1``."""
        return (self.lengths - _OVERHEAD) // 2 + 1

    @property
    def fingerprint(self) -> str:
        """A stable digest of the configuration and generator version (a cache key for lengths)."""
        text = repr((type(self).__name__, _GENERATOR_VERSION, astuple(self.config)))
        return hashlib.sha256(text.encode()).hexdigest()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        n = int(self.payload_lengths(np.array([i]))[0])
        task = self.config.tasks[int(self.task_ids(np.array([i]))[0])]
        rng = np.random.default_rng([self.config.seed, i])
        payload = rng.integers(FIRST_PAYLOAD_ID, self.config.vocab_size, size=n, dtype=np.int64)
        prompt = np.concatenate(([BOS_ID, TASK_TOKEN_IDS[task]], payload, [SEP_ID]))
        response = self.response_for(prompt)
        input_ids = np.concatenate((prompt, response))
        labels = input_ids.copy()
        labels[: len(prompt)] = IGNORE_INDEX
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}

    def response_for(self, prompt: np.ndarray | list[int] | torch.Tensor) -> np.ndarray:
        """The response (payload transformation then EOS) that answers ``[BOS, TASK, x1..xn, SEP]``.

        This is the ground truth the model has to learn; the demo can compare greedy decodes with it.
        """
        prompt = np.asarray(prompt, dtype=np.int64)
        if len(prompt) < 4 or prompt[0] != BOS_ID or prompt[-1] != SEP_ID:
            raise ValueError(f"prompt must be [BOS={BOS_ID}, TASK, x1..xn, SEP={SEP_ID}], got {prompt.tolist()}")
        task = _TASK_OF_TOKEN.get(int(prompt[1]))
        if task is None:
            raise ValueError(f"prompt[1]={int(prompt[1])} is not a task token {TASK_TOKEN_IDS}")
        return np.concatenate((_transform(task, prompt[2:-1], self.config.vocab_size), [EOS_ID]))


@functools.lru_cache(maxsize=8)
def _payload_permutation(vocab_size: int) -> np.ndarray:
    """The ``permute`` task's map of payload offsets, fixed by ``vocab_size`` alone."""
    permutation = np.random.default_rng([_PERMUTATION_SEED, vocab_size]).permutation(vocab_size - FIRST_PAYLOAD_ID)
    permutation.flags.writeable = False
    return permutation


def _target_lengths(cfg: SyntheticTaskConfig, idx: np.ndarray) -> np.ndarray:
    """Real-valued lengths drawn from the configured distribution, one per index."""
    u1 = hashed_uniform(cfg.seed, idx, _STREAM_NORMAL_A)
    if cfg.length_distribution == "uniform":
        return cfg.min_length + np.floor(u1 * (cfg.max_length - cfg.min_length + 1))
    if cfg.length_distribution == "power_law":
        scale = cfg.median_length / 2.0 ** (1.0 / cfg.alpha)  # Pareto median is scale * 2^(1/alpha)
        return scale * u1 ** (-1.0 / cfg.alpha)
    u2 = hashed_uniform(cfg.seed, idx, _STREAM_NORMAL_B)
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)  # Box-Muller
    return np.exp(np.log(cfg.median_length) + cfg.sigma * z)


def _transform(task: str, payload: np.ndarray, vocab_size: int) -> np.ndarray:
    num_payload = vocab_size - FIRST_PAYLOAD_ID
    if payload.size and (payload.min() < FIRST_PAYLOAD_ID or payload.max() >= vocab_size):
        raise ValueError(f"payload ids must lie in [{FIRST_PAYLOAD_ID}, {vocab_size}), got {payload.tolist()}")
    if task == "copy":
        return payload.copy()
    if task == "reverse":
        return payload[::-1].copy()
    if task == "sort":
        return np.sort(payload)
    offsets = payload - FIRST_PAYLOAD_ID
    if task == "shift":
        return (offsets + 1) % num_payload + FIRST_PAYLOAD_ID
    return _payload_permutation(vocab_size)[offsets] + FIRST_PAYLOAD_ID
