#!/usr/bin/env bash
# Create .venv and install everything the server and the tests need. Idempotent: a stamp file keyed on
# this script and pyproject.toml skips the work when nothing changed.
#
# Why not a plain `pip install chatterbox-tts`: chatterbox-tts 0.1.7 pins torch==2.6.0, gradio and more,
# which pulls a multi-GB CUDA torch and a web UI we do not use. We install chatterbox and its two
# companions with --no-deps, then exactly the libraries its model code imports.
#   TORCH_SPEC   torch requirement (default torch==2.13.0; a CPU wheel of it is on our CI machines)
#   PYTHON       interpreter for the venv (default python3)
#   EXTRAS       the project's extras to install (default test; deploy/Dockerfile sets none)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS-test}
stamp_key=$( (cat pyproject.toml scripts/install.sh; echo "$TORCH_SPEC $EXTRAS") | sha1sum | cut -c1-12)
stamp=.venv/.installed-$stamp_key
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if [ -f "$stamp" ]; then exit 0; fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
echo "installing into .venv (first run takes a few minutes)" >&2
pip install "$TORCH_SPEC"
pip install --no-deps chatterbox-tts==0.1.7 s3tokenizer==0.3.0 resemble-perth==1.0.1 'torchaudio==2.11.*'
pip install 'numpy<2' 'ml_dtypes<0.6' librosa==0.11.0 transformers==5.2.0 diffusers==0.29.0 safetensors==0.5.3 \
    conformer==0.3.2 omegaconf einops tqdm onnx pyloudnorm 'setuptools<81'
# torchaudio 2.11's compiled extension is built against another torch; chatterbox only uses its pure-Python
# parts (transforms.Resample, compliance.kaldi). Without the .so files torchaudio runs as pure Python.
if ! .venv/bin/python -c "import torchaudio" >/dev/null 2>&1; then
    rm -f .venv/lib/python3*/site-packages/torchaudio/lib/*.so
fi
pip install -e ".${EXTRAS:+[$EXTRAS]}"
# Riva TTS protos (riva.client.proto.*_pb2): the client pins websockets<16, which our stack is past; the
# generated modules need only grpcio and protobuf (both in pyproject.toml), so no deps.
pip install --no-deps nvidia-riva-client==2.28.0
.venv/bin/python -c "import torch, torchaudio, chatterbox.tts, synth, agent_server, av, riva.client.proto.riva_tts_pb2" 2>/dev/null \
    || { echo "install check failed: python -c 'import chatterbox.tts' to see why" >&2; exit 1; }
rm -f .venv/.installed-*
touch "$stamp"
