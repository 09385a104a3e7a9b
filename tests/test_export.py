from __future__ import annotations

import pytest
import torch

from lit_seqpack.export import export_command


@pytest.mark.parametrize("content", ["random", "truncated"])
def test_export_of_a_corrupt_checkpoint_names_the_file(tmp_path, content):
    path = tmp_path / "last.ckpt"
    if content == "random":
        path.write_bytes(bytes(range(256)) * 8)
    else:
        torch.save({"state_dict": {"w": torch.zeros(64)}}, path)
        path.write_bytes(path.read_bytes()[:200])  # a copy cut short
    with pytest.raises(ValueError, match=rf"--ckpt_path {path}: not a readable checkpoint"):
        export_command(["--ckpt_path", str(path), "--output_dir", str(tmp_path / "hf")])
