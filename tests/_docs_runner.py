"""Run the code blocks of the docs: ``python -m tests._docs_runner pages.json`` (what tests/test_docs.py does).

Each page runs in a sandbox folder of its own that holds what the docs' examples name: ``configs/``,
``examples/``, ``benchmarks/`` and ``scripts/`` of the repository, tiny pre-tokenised files ``data/train.jsonl`` and
``data/val.jsonl``, raw text ``data/text.jsonl``, conversations ``data/chat.jsonl`` / ``data/chat_val.jsonl`` and a
local ``tokenizer/`` (the package's chat demo assets). Every Lightning ``Trainer`` is capped at 3 optimizer steps and
2 evaluation batches, so a page's examples keep their real settings (``max_steps=200``) and still run in seconds.
Prints one JSON line per block, ``{"where": ..., "status": ..., "seconds": ...}`` or ``{"where": ..., "error": ...}``
(a page stops at its first failing block).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import runpy
import shlex
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

from tests._docs_blocks import ROOT, commands

MAX_STEPS = 3
_CLI_KEYS = {"trainer", "model", "data", "seed_everything", "torch_num_threads", "optimizer", "lr_scheduler"}
_BASE_CONFIG = {  # what a config excerpt of the docs is layered on: a tiny model on the embedded task
    "trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False},
    "model": {"class_path": "lit_seqpack.model.lm.ReferenceLM", "init_args": {"n_layer": 1, "n_embd": 32}},
    "data": {"source": {"class_path": "lit_seqpack.data.sources.SyntheticInstructionDataset"}, "max_tokens": 256},
}


class _Parsed(Exception):
    """Raised by a script's argument parser once it has parsed: the command line is valid, the script stops."""


def make_sandbox(folder: Path) -> None:
    """Fill ``folder`` with the files the docs' examples name (see the module docstring)."""
    for name in ("configs", "examples", "benchmarks", "scripts"):
        (folder / name).symlink_to(ROOT / name)
    data = folder / "data"
    data.mkdir()
    rows = [{"input_ids": [1 + (i * 7 + j) % 60 for j in range(8 + i % 23)]} for i in range(64)]
    for name, part in (("train", rows[:56]), ("val", rows[56:])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    words = ["the", "cat", "sat", "on", "a", "mat", "what", "is", "one", "plus", "two"]
    text = [{"text": " ".join(words[(i + j) % len(words)] for j in range(5 + i % 9))} for i in range(64)]
    (data / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    assets = ROOT / "lit_seqpack" / "data" / "assets" / "chat_demo"
    shutil.copy(assets / "chat.jsonl", data / "chat.jsonl")
    shutil.copy(assets / "chat_val.jsonl", data / "chat_val.jsonl")
    shutil.copytree(assets / "tokenizer", folder / "tokenizer")


def _cap_trainers() -> None:
    """Cap every ``Trainer.fit`` / ``validate`` / ``test`` (the Trainer's signature stays as it is for the CLI)."""
    from lightning.pytorch import Trainer

    def capped(method: Any) -> Any:
        @functools.wraps(method)  # LightningCLI reads the subcommands' arguments from these signatures
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            loop, steps = self.fit_loop, self.fit_loop.max_steps
            loop.epoch_loop.max_steps = MAX_STEPS if steps in (None, -1) else min(steps, MAX_STEPS)
            loop.max_epochs = 1
            self.limit_val_batches = self.limit_test_batches = 2
            self.num_sanity_val_steps = 0
            return method(self, *args, **kwargs)

        return run

    for name in ("fit", "validate", "test"):
        setattr(Trainer, name, capped(getattr(Trainer, name)))


@contextlib.contextmanager
def _stop_after_parsing() -> Any:
    """Within: ``argparse`` raises :class:`_Parsed` once ``parse_args`` parsed a command line without error."""
    parse = argparse.ArgumentParser.parse_args

    def parsed(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parse(self, *args, **kwargs)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parsed
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = parse


@contextlib.contextmanager
def _refusal_named(line: str) -> Any:
    """Within: a parser's exit with an error becomes a ``ValueError`` holding what it wrote to stderr."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise ValueError(f"{line!r} exited with {exit_.code}: {err.getvalue()[-2000:]}") from None
    finally:
        sys.stderr.write(err.getvalue()[-2000:])


def _cli(args: list[str]) -> str:
    """Parse a ``lit-seqpack`` command line without running it."""
    sub, rest = args[0], args[1:]
    if sub == "inspect":
        from lit_seqpack.__main__ import build_inspect_parser

        with _refusal_named(shlex.join(["lit-seqpack", *args])):
            build_inspect_parser().parse_args(rest)
        return "parsed"
    if sub == "export":
        from lit_seqpack.export import build_export_parser

        with _refusal_named(shlex.join(["lit-seqpack", *args])):
            build_export_parser().parse_args(rest)
        return "parsed"
    if sub == "generate":
        from lit_seqpack.generate import build_generate_parser

        with _refusal_named(shlex.join(["lit-seqpack", *args])):
            build_generate_parser().parse_args(rest)
        return "parsed"
    if sub not in ("fit", "validate", "test", "predict"):
        raise ValueError(f"unknown lit-seqpack subcommand {sub!r}")
    from lit_seqpack.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()), _refusal_named(shlex.join(["lit-seqpack", *args])):
        main([*args, "--print_config"] if "--print_config" not in args else args)
    return "parsed"


def _script(args: list[str]) -> str:
    """Parse a ``python script.py ...`` command line with the script's own parser, without running the script."""
    script = Path(args[0])
    if not script.is_file():
        raise FileNotFoundError(f"no such script: {script}")
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args[1:]]
    sys.path.insert(0, str(script.resolve().parent))  # as `python script.py` does: its folder's modules import
    try:
        with _stop_after_parsing(), _refusal_named(shlex.join(["python", *args])):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return "parsed"
    finally:
        sys.argv, sys.path[:] = argv, path
    return "ran"


def run_command(line: str) -> str:
    """Check one shell command of a docs page; return how (``parsed``, ``ran``, ``exists``, ``not run``)."""
    args = shlex.split(line)
    head = args[0]
    if head == "lit-seqpack" or head.endswith("/bin/lit-seqpack"):
        return _cli(args[1:])
    if head in ("python", "python3") or head.endswith("/python"):
        if args[1:3] == ["-m", "lit_seqpack"]:
            return _cli(args[3:])
        return "not run" if args[1] == "-m" else _script(args[1:])
    if head == "bash":
        if not Path(args[1]).is_file():
            raise FileNotFoundError(f"no such script: {args[1]}")
        return "exists"
    quiet = ("pip", "mkdocs", "cd", "git", "tensorboard", "source")
    if head in quiet or head.endswith("/ruff") or head.endswith("/pip"):
        return "not run"
    raise ValueError(f"the docs test does not know how to check {line!r}: mark the block as an excerpt")


def run_yaml(code: str, parse_only: str | None = None) -> str:
    """Parse a YAML block; instantiate a config (layered on a tiny base when it is only a part of one), or with
    ``parse_only`` check it with the ``fit`` parser alone."""
    config = yaml.safe_load(code)
    if not isinstance(config, dict) or not set(config) & _CLI_KEYS:
        return "parsed"
    from lit_seqpack.cli import SeqPackCLI

    files = []
    if not {"model", "data"} <= set(config):
        Path("base.yaml").write_text(yaml.safe_dump(_BASE_CONFIG))
        files += ["--config", "base.yaml"]
    Path("block.yaml").write_text(code)
    if parse_only:
        _cli(["fit", *files, "--config", "block.yaml"])
        return f"parsed (parse-only: {parse_only})"
    with _refusal_named(f"the config {code[:200]!r}"):
        SeqPackCLI(args=[*files, "--config", "block.yaml"], run=False)
    return "instantiated"


def run_block(block: dict[str, Any]) -> str:
    """Run one block (see tests/_docs_blocks.py for what each language means)."""
    if block["lang"] == "python":
        exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})  # noqa: S102
        return "ran"
    if block["lang"] == "yaml":
        return run_yaml(block["code"], block.get("parse_only"))
    return ", ".join(f"{run_command(line)}: {line}" for line in commands(block["code"]))


def run_page(blocks: list[dict[str, Any]]) -> None:
    """Run one page's blocks in order; after a failure, report it and leave the page's other blocks."""
    for block in blocks:
        start = time.perf_counter()
        try:
            status = run_block(block)
        except (Exception, SystemExit):  # report any failure with the block's place
            print(json.dumps({"where": block["where"], "error": traceback.format_exc()[-4000:]}), flush=True)
            return
        seconds = round(time.perf_counter() - start, 2)
        print(json.dumps({"where": block["where"], "status": status, "seconds": seconds}), flush=True)


def main() -> None:
    """Run the pages listed in the JSON file ``sys.argv[1]`` (``{page: [block, ...]}``), each in a sandbox of its
    own under the working directory, in one process (torch and Lightning are imported once)."""
    pages = json.loads(Path(sys.argv[1]).read_text())
    sys.argv = sys.argv[:1]  # the blocks' CLIs read their own arguments
    import torch

    torch.set_num_threads(1)
    _cap_trainers()
    root = Path.cwd()
    for number, (page, blocks) in enumerate(pages.items()):
        sandbox = root / f"page{number}"
        sandbox.mkdir()
        make_sandbox(sandbox)
        os.chdir(sandbox)
        print(json.dumps({"page": page, "sandbox": str(sandbox)}), flush=True)
        run_page(blocks)
    os.chdir(root)


if __name__ == "__main__":
    main()
