from __future__ import annotations

import importlib
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


def test_model_all_matches_lazy_exports_and_every_name_resolves():
    """Names that moved inside model/ (the isolation names left ``model.hf``) still resolve from both packages."""
    import lit_seqpack.model as model

    assert sorted(model.__all__) == sorted(model._EXPORTS)
    for name in model.__all__:
        assert getattr(model, name) is getattr(importlib.import_module(model._EXPORTS[name]), name), name
    model_names = [name for name, path in lit_seqpack._EXPORTS.items() if path.startswith("lit_seqpack.model")]
    assert "PackingLeakError" in model_names
    for name in model_names:
        assert getattr(lit_seqpack, name) is getattr(model, name), name
