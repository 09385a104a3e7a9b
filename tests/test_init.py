from __future__ import annotations

import subprocess
import sys

import lit_seqpack


def test_all_matches_lazy_exports():
    assert sorted(lit_seqpack.__all__) == sorted(lit_seqpack._EXPORTS)


def test_import_touches_neither_torch_nor_cuda():
    code = "import sys, lit_seqpack; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_planning_all_matches_lazy_exports():
    import lit_seqpack.planning as planning

    assert sorted(planning.__all__) == sorted(planning._EXPORTS)
