#!/usr/bin/env bash
# Test lit-seqpack against the NEWEST releases pyproject.toml allows (the twin of scripts/lowest_versions.sh).
#
#   bash scripts/newest_versions.sh                  # build .venv-newest, run the default test selection
#   bash scripts/newest_versions.sh tests/model      # ... or these pytest arguments instead
#   bash scripts/newest_versions.sh tests lit_seqpack   # the whole suite, as .ci/run runs it
#
# The venv is built apart from .venv (NEWEST_VENV to choose its folder; it is rebuilt from scratch each time) with
# uv at its default resolution (the highest version of every requirement of the project and of [dev], nothing
# cached from an older lock), so a release published after the last landing (transformers 5.25 routing Falcon through
# AttentionInterface, ...) is tested before users meet it. torch is installed by pip first, as scripts/setup_env.sh
# does (TORCH_SPEC, default the newest `torch`), so that pip's own configuration picks a CPU wheel where there is one.
# The resolved versions are printed and written to $NEWEST_VENV/resolved.txt: copy them into the "newest tested"
# column of docs/getting-started.md's version table.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${NEWEST_VENV:-$root/.venv-newest}"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch}"
uv_version="0.13.9"

if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "NEWEST_VENV=$venv exists and is not a virtual environment: not deleting it" >&2
  exit 1
fi
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade)
"${pip[@]}" "uv==$uv_version" "$torch_spec"
overrides="$venv/overrides.txt"
"$venv/bin/python" -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" >"$overrides"
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --upgrade --override "$overrides" -e ".[dev,docs,litdata]"
# litdata itself without its requirements (they pull torchvision and another torch), as scripts/setup_env.sh does
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps "litdata>=0.2.76"
"$venv/bin/uv" pip freeze --python "$venv/bin/python" | grep -v '^-e ' >"$venv/resolved.txt"
grep -iE '^(torch|lightning|litdata|mkdocs|torchmetrics|torchdata|numpy|numba|omegaconf|jsonargparse|transformers|peft|datasets|pyarrow|tensorboard|matplotlib|huggingface-hub|tokenizers|pytest)==' \
  "$venv/resolved.txt"

if [ "$#" -eq 0 ]; then
  # the lowest-versions selection, plus the tests that pin what an upstream release may change (HF dispatch)
  set -- -m "not slow" \
    tests/test_imports.py tests/planning/test_plan.py tests/planning/test_algorithms.py \
    tests/data/test_datamodule.py tests/data/test_loader.py tests/data/test_resume.py tests/data/test_samplers.py \
    tests/data/test_collate.py tests/test_metrics.py tests/test_callbacks.py tests/test_cli.py tests/test_configs.py \
    tests/model/test_hf.py tests/model/test_hf_load.py tests/model/test_lm.py tests/data/sources/test_tokenized.py \
    tests/data/sources/test_chat.py tests/data/sources/test_file_fields.py tests/test_inspection.py \
    tests/model/test_hf_unsupported.py tests/model/test_hf_shared_config.py
fi
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
