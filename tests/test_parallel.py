"""``lit_seqpack.parallel`` is shared by the data and model layers: it loads no collator, and the old import paths
of its names still work."""

from __future__ import annotations

import subprocess
import sys


def test_importing_parallel_loads_no_collator_and_no_model():
    code = (
        "import sys, lit_seqpack.parallel; "
        "print(sorted(m for m in sys.modules if m.startswith(('lit_seqpack.data.c', 'lit_seqpack.model'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_cp_attention_and_the_mixin_do_not_load_the_collators():
    for module in ("lit_seqpack.model.cp_attention", "lit_seqpack.model.mixin"):
        code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('lit_seqpack.data.c')))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        assert out == "[]", module


def test_the_old_import_paths_give_the_same_objects():
    import lit_seqpack.data._layout as old_layout
    import lit_seqpack.data.context_parallel as old_cp
    import lit_seqpack.parallel as parallel

    for name in ("ParallelLayout", "context_parallel_index", "gather_packed_batches", "shard_packed_batch"):
        assert getattr(old_cp, name) is getattr(parallel, name)
    for name in ("shard_tokens", "unshard_tokens"):
        assert getattr(old_cp, name) is getattr(parallel, name)
    for name in ("MeshLayout", "check_mesh", "mesh_layout", "strategy_mesh"):
        assert getattr(old_layout, name) is getattr(parallel, name)
