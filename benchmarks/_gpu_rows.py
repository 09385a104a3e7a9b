"""Pieces of ``benchmarks/gpu.py``: the no-padding bound, model FLOPs and MFU, fault-tolerant rounds, GPU tests.

``benchmarks/`` is ``sys.path[0]`` when a benchmark runs as a script, so ``gpu.py`` imports ``_gpu_rows``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _train_loop import ModeRun

from lit_seqpack.metrics.flops import PEAK_FLOPS, training_flops
from lit_seqpack.model.attention import route_varlen_attention, varlen_attention
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder

BOUND = "no-padding bound"
"""The row name of the bound: the same documents' tokens with no padding and no cross-document work."""


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    """The bf16 peak MFU is measured against, and where it comes from (the library's table, ``PEAK_FLOPS``)."""
    if override_tflops:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak-tflops)"
    if device.type != "cuda":
        return None, "none on a CPU (MFU n/a; --peak-tflops sets one)"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS:
        if key in name:
            return peak, f"{peak / 1e12:g} TFLOP/s, dense bf16 data-sheet peak of the {key}"
    return None, f"unknown for {name!r} (MFU n/a; --peak-tflops sets one)"


def flops_per_real_token(config: ReferenceConfig, lengths: np.ndarray) -> float:
    """Useful training FLOPs (forward + backward) per real token of these documents: ``training_flops`` / tokens.

    ``lit_seqpack.metrics.flops.training_flops`` of the reference decoder (built on the meta device: no memory):
    ``6 N`` per token for the matmuls plus causal attention ``6 x n_layer x n_embd x sum(L^2)``, per document.
    Padding and cross-document work are not useful work: the same figure for every mode, so MFU compares modes on
    the same numerator.

    Example:
        >>> config = ReferenceConfig.preset("tiny")
        >>> round(flops_per_real_token(config, np.array([4, 4])))
        137664
    """
    with torch.device("meta"):
        model = ReferenceDecoder(config)
    lengths = [int(n) for n in np.asarray(lengths)]
    return training_flops(model, lengths) / sum(lengths)


def _no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Attention's place in the bound's model: a few elementwise ops that keep q, k and v in the graph."""
    return q + (k + v).repeat_interleave(q.shape[1] // k.shape[1], dim=1)


class BoundRun(ModeRun):
    """The no-padding bound: the model's work on exactly the real tokens plus the attention kernel on exactly them.

    The batches are the packing plan's rows collated without a padding tail (``pad_to_multiple_of=1``): the same
    documents, only real tokens. Each microbatch is timed in two parts that add up: the training step with the
    attention replaced by :func:`_no_attention` (embeddings, norms, projections, MLP, loss, backward, AdamW on
    the real tokens), then ``n_layer`` forward + backward calls of the fastest varlen kernel (``backend``) on the
    same documents (causal, inside each document: no cross-document work). Its held-out loss is meaningless (it
    trains without attention) and is not reported.

    Args:
        args: see :class:`~_train_loop.ModeRun`.
        config: the model's sizes (heads, head size, layers).
        backends: varlen attention backends for the attention part, fastest first; one that raises is dropped for
            the next (``backend`` says which one ran).
        kwargs: see :class:`~_train_loop.ModeRun`.
    """

    def __init__(self, *args: Any, config: ReferenceConfig, backends: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config, self.backends, self.attention_seconds = config, list(backends), 0.0
        step = self.module.training_step

        def training_step(batch: dict[str, Any], index: int) -> torch.Tensor:
            with route_varlen_attention(_no_attention):
                return step(batch, index)

        self.module.training_step = training_step

    def _count(self, batch: dict[str, Any], wall: float, cpu: float) -> None:
        attention_wall, attention_cpu = self._attention(batch)
        if self.microbatches + 1 > self.warmup:
            self.attention_seconds += attention_wall
        super()._count(batch, wall + attention_wall, cpu + attention_cpu)

    def _attention(self, batch: dict[str, Any]) -> tuple[float, float]:
        """Seconds of ``n_layer`` varlen attention calls, forward + backward, on this batch's documents."""
        c, tokens = self.config, batch["input_ids"].shape[1]
        dtype = next(self.module.parameters()).dtype
        make = lambda heads: torch.randn(tokens, heads, c.head_dim, device=self.device, dtype=dtype,  # noqa: E731
                                         requires_grad=True)  # fmt: skip
        q, k, v = make(c.n_head), make(c.n_kv_head), make(c.n_kv_head)
        grad = torch.randn_like(q)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(c.n_layer):
            self._call(q, k, v, batch).backward(grad)
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - wall, time.process_time() - cpu

    @property
    def backend(self) -> str:
        """The backend the attention part runs on."""
        return self.backends[0]

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        while True:
            try:
                return varlen_attention(q, k, v, batch["cu_seqlens"], batch["max_seqlen"], backend=self.backend)
            except Exception:
                if len(self.backends) == 1:
                    raise
                self.backends.pop(0)  # this kernel fails here: the next one


def short_error(err: BaseException) -> str:
    """``Type: first line`` of an exception, at most 160 characters (a table cell)."""
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return text[:160]


def train_rounds(runs: dict[str, ModeRun], total: int, rounds: int, deadline: float) -> tuple[dict[str, str], int]:
    """Interleave the modes in ``rounds`` rounds of real tokens until the epoch or the ``deadline`` ends.

    A mode that raises (a kernel missing on this machine, out of memory) is dropped with its error and its
    module and optimizer released; the others go on. Returns the errors by mode and the rounds completed.
    """
    failed: dict[str, str] = {}
    done = 0
    for index in range(1, rounds + 1):
        if time.perf_counter() > deadline:
            break
        names = [name for name in runs if name not in failed]
        shift = index % max(len(names), 1)
        for name in names[shift:] + names[:shift]:  # rotate the order: no mode always runs first
            try:
                runs[name].train_until(total * index // rounds)
            except Exception as err:  # noqa: BLE001 - one failing row must not end the table
                failed[name] = short_error(err)
                release(runs[name])
        done = index
    return failed, done


def release(run: ModeRun) -> None:
    """Free a failed mode's model and optimizer (and the CUDA cache) so the other modes keep their memory."""
    run.module = run.optimizer = run.scheduler = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_test_files(root: Path) -> list[Path]:
    """The test files holding ``@pytest.mark.gpu`` tests (collected alone: the other files may need packages
    the GPU machine lacks)."""
    return sorted(p for p in (root / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


_HYPOTHESIS_STUB = """
# A stand-in for hypothesis where it is not installed: the property tests it decorates are skipped (-m gpu
# deselects them anyway); the gpu-marked tests in the same files can then be collected and run.
import pytest


class _Anything:
    def __getattr__(self, name):
        return self

    def __call__(self, *args, **kwargs):
        return self


def given(*args, **kwargs):
    return lambda fn: pytest.mark.skip(reason="hypothesis is not installed")(fn)


def settings(*args, **kwargs):
    return lambda fn: fn


strategies = _Anything()


def __getattr__(name):
    return _Anything()
"""


def run_gpu_tests(root: Path, timeout: float) -> dict[str, Any]:
    """``pytest -m gpu`` over :func:`gpu_test_files` in a subprocess; the summary line and the output's tail.

    Where ``hypothesis`` is missing (the GPU machine may lack it) a stub on ``PYTHONPATH`` lets the files that
    import it be collected.
    """
    if importlib.util.find_spec("pytest") is None:
        return {"files": [], "returncode": None, "summary": "pytest is not installed", "seconds": 0.0, "tail": []}
    files = [str(p.relative_to(root)) for p in gpu_test_files(root)]
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
               "--strict-markers", "-ra", "--continue-on-collection-errors", *files]  # fmt: skip
    env = dict(os.environ)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as stubs:
        if importlib.util.find_spec("hypothesis") is None:
            (Path(stubs) / "hypothesis").mkdir()
            (Path(stubs) / "hypothesis" / "__init__.py").write_text(_HYPOTHESIS_STUB)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [stubs, env.get("PYTHONPATH")]))
            command[3:3] = ["-p", "no:hypothesispytest"]  # the real plugin, if any, would import the stub
        try:
            result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
            output, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired as err:
            output, code = f"{_text(err.stdout)}{_text(err.stderr)}\ntimed out after {timeout:.0f} s", -1
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    return {"files": files, "returncode": code, "summary": summary or (lines[-1] if lines else ""),
            "seconds": round(time.perf_counter() - started, 1), "tail": lines[-40:]}  # fmt: skip


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""
