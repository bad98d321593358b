#!/usr/bin/env bash
# Wheels for a lent GPU machine (Python 3.12 with its own CUDA torch/torchaudio/numpy/scipy/numba/transformers/
# tokenizers/huggingface-hub/safetensors, no network): what synth/ and the server (for scripts/bench_capacity.py)
# import that its image LACKS, pinned as scripts/install.sh / pyproject.toml resolve them here, into .whl/ (ignored by
# git; ~40 MB, well under the device's 64 MiB carry with the tree).
#
# Only what the image lacks: scripts/gpu_check.sh installs these with --no-deps into /tmp/site and puts that folder
# AFTER the image's site-packages (a .pth file), so a carried wheel never shadows a package of the image, and every
# carried wheel's own needs come from the image. transformers and tokenizers are the image's (5.17.0 and 0.23.2 when
# last listed, /work/.library/device/KINDS.md): the engine's equivalence with chatterbox's inference, its voices and
# its reference tests passed under them, Python 3.12, torch 2.11.0, numpy 2.5.2 and huggingface-hub 1.33.0 (a clean
# venv of those with these wheels, BENCHMARKS.md "GPU check, issue 34"). Carrying transformers 5.2.0 instead needed
# a tokenizers pin (the image's 0.23.2 fails 5.2.0's import-time check) and shadowed the image's copies.
# Left out on purpose: resemble-perth (34 MB watermarker model, never used by synth/; gpu_check.sh puts an empty
# `perth` module on the path so `import chatterbox` works); docopt (an sdist, imported only by num2words' command line).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    chatterbox-tts==0.1.7 s3tokenizer==0.3.0 diffusers==0.29.0 \
    conformer==0.3.2 omegaconf==2.3.0 librosa==0.11.0 audioread soxr pooch decorator pyloudnorm soundfile \
    cffi pycparser platformdirs \
    starlette==1.10.0 uvicorn==0.55.0 websockets==17.4 wsproto==1.3.2 orjson==3.13.0 structlog==26.1.0 \
    python-multipart==0.0.34 av==18.1.0 redis==8.2.0 nvidia-riva-client==2.28.0 num2words==0.5.14
# antlr4-python3-runtime 4.9.3 (omegaconf's parser) is published as an sdist only: build its pure-Python wheel
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl
