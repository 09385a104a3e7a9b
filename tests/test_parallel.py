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
