"""``lit-seqpack inspect``: every mode and algorithm compared on the config's data, a table and a PNG."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from lit_seqpack.__main__ import inspect_command, main
from lit_seqpack.inspection import compare_plans, default_padded_batch_size, format_table, plot_inspection
from lit_seqpack.planning import PACKING_ALGORITHMS, PlanConfig, build_plan

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
SMALL = ["--data.source.init_args.num_samples=600", "--data.max_tokens=256", "--data.source.init_args.max_length=200"]
LENGTHS = np.random.default_rng(0).integers(4, 120, size=300)


def _config(**changes) -> PlanConfig:
    return PlanConfig(**{"mode": "packing", "max_tokens": 128, "world_size": 2, "accumulate_grad_batches": 2} | changes)


def test_every_mode_and_algorithm_in_order_with_the_plans_own_stats():
    rows = compare_plans(LENGTHS, _config(algorithm="best_fit_decreasing", max_tokens=512))
    assert [(r.config.mode, r.config.algorithm) for r in rows] == [
        *(("packing", a) for a in PACKING_ALGORITHMS),
        ("dynamic", None),
        ("padded", None),
    ]
    assert [r.configured for r in rows] == [a == "best_fit_decreasing" for a in PACKING_ALGORITHMS] + [False, False]
    for row in rows:
        assert row.config.world_size == 2 and row.config.accumulate_grad_batches == 2
        assert row.stats == build_plan(LENGTHS, row.config, epoch=0).stats
        assert row.fills.size == row.stats.num_microbatches
        assert row.fills.mean() == pytest.approx(row.stats.utilization)
        assert row.seconds >= 0
    padded = rows[-1]
    assert padded.config.max_tokens is None
    assert padded.config.batch_size == default_padded_batch_size(LENGTHS, 512) == int(512 // LENGTHS.mean())
    assert padded.stats.padding_ratio > rows[1].stats.padding_ratio  # the baseline pads more than packing


def test_padded_configuration_keeps_its_batch_size_and_needs_a_budget_for_the_others():
    padded = PlanConfig(mode="padded", batch_size=5)
    with pytest.raises(ValueError, match="max_tokens"):
        compare_plans(LENGTHS, padded)
    rows = compare_plans(LENGTHS, padded, max_tokens=128)
    assert rows[-1].configured and rows[-1].config.batch_size == 5
    assert rows[0].config.max_tokens == 128 and not any(r.configured for r in rows[:-1])


def test_per_document_padding_is_planned_for_packing_rows():
    rows = compare_plans(LENGTHS, _config(), pad_to_multiple_of=16)
    padded_lengths = (LENGTHS + 15) // 16 * 16
    assert rows[1].stats.real_tokens == int(padded_lengths.sum())  # the packer sees what the row will hold
    assert rows[5].stats.real_tokens == int(LENGTHS.sum())  # dynamic batching pads rows, not documents


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [({"padded_batch_size": 0}, "padded_batch_size"), ({"pad_to_multiple_of": -2}, "pad_to_multiple_of")],
)
def test_bad_settings_are_named(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        compare_plans(LENGTHS, _config(), **kwargs)


def test_table_lists_every_row_and_marks_the_configured_one():
    rows = compare_plans(LENGTHS, _config())
    table = format_table(rows).splitlines()
    assert table[0].split()[:2] == ["mode", "algorithm"] and len(table) == 1 + len(rows)
    for line, row in zip(table[1:], rows, strict=True):
        assert line.startswith(row.config.mode) and f"{row.stats.num_microbatches:,}" in line
        assert ("*" in line) == row.configured
        assert f"{row.stats.padding_ratio:.2%}" in line


def test_plot_writes_a_png(tmp_path):
    rows = compare_plans(LENGTHS, _config())
    path = plot_inspection(rows, LENGTHS, tmp_path / "plan.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'lit-seqpack\[plotting\]'"):
        plot_inspection(compare_plans(LENGTHS[:20], _config()), LENGTHS[:20], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_inspect_reads_the_fit_config_and_writes_the_plot(tmp_path, capsys):
    png = tmp_path / "out.png"
    main(["inspect", "--config", str(DEMO), *SMALL, "--plot", str(png)])
    out = capsys.readouterr().out
    assert "training samples" in out and "max_tokens=256" in out and "data-parallel ranks=1" in out
    for name in (*PACKING_ALGORITHMS, "dynamic", "padded"):
        assert name in out
    configured = [line for line in out.splitlines() if "*" in line and line.startswith("packing")]
    assert len(configured) == 1 and "first_fit_decreasing" in configured[0]
    assert png.read_bytes()[:4] == b"\x89PNG" and f"plot: {png}" in out


def test_inspect_takes_the_layout_from_the_trainer_section_and_flags_override_it():
    ddp = str(ROOT / "configs" / "ddp.yaml")
    text = inspect_command(["--config", ddp, "--data.source.init_args.num_samples=400"])
    assert "data-parallel ranks=2" in text and "accumulate_grad_batches=2" in text
    text = inspect_command(
        ["--config", ddp, "--data.source.init_args.num_samples=400", "--world_size=4", "--data.mode=dynamic"]
    )
    assert "data-parallel ranks=4" in text
    configured = [line for line in text.splitlines() if "*" in line and not line.startswith("*")]
    assert len(configured) == 1 and configured[0].startswith("dynamic")


def test_inspect_notes_a_hardware_dependent_device_count():
    text = inspect_command(
        [
            "--data.source=SyntheticInstructionDataset",
            "--data.source.init_args.num_samples=300",
            "--trainer",
            '{"devices": "auto"}',
        ]
    )
    assert "depends on the hardware" in text and "data-parallel ranks=1" in text


@pytest.mark.parametrize(
    ("argv", "knob"),
    [
        (["--world_size=0"], "world_size"),
        (["--accumulate_grad_batches=-1"], "accumulate_grad_batches"),
        (["--data.algorithm=tetris"], "algorithm"),
    ],
)
def test_inspect_bad_values_are_named(argv, knob):
    with pytest.raises(ValueError, match=knob):
        inspect_command(["--data.source=SyntheticInstructionDataset", "--data.source.init_args.num_samples=100", *argv])


def test_inspect_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--world_size" in text and "--plot" in text and "--data.max_tokens" in text


def test_inspect_dataclass_rows_are_frozen():
    row = compare_plans(LENGTHS, _config())[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.seconds = 0.0


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_inspect_reads_every_shipped_config(path):
    argv = ["--config", str(path)]
    if "SyntheticInstructionDataset" in path.read_text():  # a smaller task (chat_sft.yaml reads its committed assets)
        argv.append("--data.source.init_args.num_samples=300")
    if "mode: padded" in path.read_text():
        with pytest.raises(ValueError, match=r"pass --data.max_tokens N"):
            inspect_command(argv)
        argv.append("--data.max_tokens=1024")
    text = inspect_command(argv)
    assert sum("*" in line for line in text.splitlines()[3:-1]) == 1  # exactly one configured row
