#!/usr/bin/env bash
# Test lit-seqpack against the LOWEST versions pyproject.toml allows (its direct dependencies and the [dev] extra).
#
#   bash scripts/lowest_versions.sh                  # build .venv-lowest, run the default test selection
#   bash scripts/lowest_versions.sh tests/test_cli.py -k resume   # ... or these pytest arguments instead
#   bash scripts/lowest_versions.sh tests lit_seqpack   # the whole suite, as .ci/run runs it
#
# The venv is built apart from .venv (LOWEST_VENV to choose its folder; it is rebuilt from scratch each time) with
# uv: every `name>=lower` requirement of the project and of [dev] pinned to `name==lower` (scripts/lowest_pins.py),
# the rest at the newest version compatible with them. (uv's `--resolution lowest-direct` is a preference, not a
# guarantee: it left datasets and pyarrow above their bounds here.) torch is the exception: TORCH_SPEC (default torch==2.13.0, installed by pip first as
# scripts/setup_env.sh does, so that pip's own configuration picks a CPU wheel where there is one) stands for
# torch's lower bound, because torch from PyPI pulls gigabytes of CUDA wheels. The resolved versions are printed
# and written to $LOWEST_VENV/resolved.txt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${LOWEST_VENV:-$root/.venv-lowest}"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
uv_version="0.13.9"

if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "LOWEST_VENV=$venv exists and is not a virtual environment: not deleting it" >&2
  exit 1
fi
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "uv==$uv_version" "tomli; python_version < '3.11'" "$torch_spec"
pins="$venv/lowest-pins.txt"
"$venv/bin/python" scripts/lowest_pins.py --skip torch >"$pins"
overrides="$venv/overrides.txt"
"$venv/bin/python" -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" >"$overrides"
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --constraint "$pins" --override "$overrides" -e ".[dev,docs,litdata]"
# litdata itself without its requirements (they pull torchvision and another torch), as scripts/setup_env.sh does
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps "litdata==0.2.76"
"$venv/bin/uv" pip freeze --python "$venv/bin/python" | grep -v '^-e ' >"$venv/resolved.txt"
grep -iE '^(torch|lightning|litdata|mkdocs|torchmetrics|torchdata|numpy|numba|omegaconf|jsonargparse|transformers|peft|datasets|pyarrow|tensorboard|matplotlib|huggingface-hub|tokenizers|pytest)==' \
  "$venv/resolved.txt"

if [ "$#" -eq 0 ]; then
  # the non-slow tests that exercise the dependencies: Lightning's loops and CLI, torchdata, torchmetrics,
  # jsonargparse, transformers and peft, pyarrow and datasets, numba's planner kernels
  set -- -m "not slow" \
    tests/test_imports.py tests/planning/test_plan.py tests/planning/test_algorithms.py \
    tests/data/test_datamodule.py tests/data/test_loader.py tests/data/test_resume.py tests/data/test_samplers.py \
    tests/data/test_collate.py tests/test_metrics.py tests/test_callbacks.py tests/test_cli.py tests/test_configs.py \
    tests/model/test_hf.py tests/model/test_hf_load.py tests/model/test_lm.py tests/data/sources/test_tokenized.py \
    tests/data/sources/test_chat.py tests/data/sources/test_file_fields.py tests/test_inspection.py
fi
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
