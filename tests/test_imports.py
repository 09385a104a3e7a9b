from __future__ import annotations

import subprocess
import sys

import pytest

from lit_seqpack import _imports
from lit_seqpack._imports import require


def test_require_returns_the_module():
    assert require("json.decoder", purpose="x").__name__ == "json.decoder"


@pytest.mark.parametrize(
    ("module", "fix"),
    [
        ("pyarrow.parquet", "pip install 'lit-seqpack[parquet]' (or pip install pyarrow)"),
        ("matplotlib.figure", "pip install 'lit-seqpack[plotting]' (or pip install matplotlib)"),
        ("transformers", "pip install 'lit-seqpack[transformers]'"),
        ("no_such_package_xyz", "pip install no_such_package_xyz"),
    ],
)
def test_a_missing_package_names_the_purpose_and_the_install(monkeypatch, module, fix):
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, module.split(".")[0], None)  # None in sys.modules: the import fails
    with pytest.raises(ImportError, match="reading things needs the optional package") as caught:
        require(module, purpose="reading things")
    assert fix in str(caught.value)


def test_the_flags_import_nothing_until_asked():
    code = (
        "import sys, lit_seqpack._imports as i\n"
        "assert not {'torch', 'transformers', 'flash_attn', 'pyarrow', 'matplotlib'} & set(sys.modules)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_no_module_imports_an_optional_package_outside_the_one_place():
    """Every optional import goes through require(): a bare ``import transformers`` has no actionable error."""
    import ast
    from pathlib import Path

    optional = {"transformers", "peft", "pyarrow", "datasets", "matplotlib", "flash_attn", "tensorboard"}
    root = Path(_imports.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in optional]
    # flash-attn keeps its own loader: its failure is an OSError as often as an ImportError (see model/attention.py)
    assert offenders == ["model/attention.py: flash_attn"]
