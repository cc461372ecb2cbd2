# torchtitan training image. The launcher is the entrypoint, so arguments are config overrides:
#   docker build -t torchtitan .
#   docker run --rm --gpus all --ipc=host torchtitan --training.steps 10
# and the launcher's environment variables (NGPU, CONFIG_FILE, NNODES/NODE_RANK/MASTER_ADDR, the
# Kubeflow PET_* ones, ...) choose the launch, as on a bare machine (docs/kubernetes.md).
#
# BASE_IMAGE: an official CUDA PyTorch image. Its torch, built for its CUDA, is the one used:
# requirements.txt is installed without its torch pin. The default tag is torch 2.13.0 (the
# version requirements.txt pins) on CUDA 12.6 with cuDNN 9, from the tags listed on
# https://hub.docker.com/r/pytorch/pytorch/tags (pick another CUDA there to match your driver).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="torchtitan" \
      org.opencontainers.image.description="Llama pretraining with native PyTorch; entrypoint run_llama_train.sh"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/torchtitan

# Dependencies first, so this layer survives code edits. The torch line is dropped, and the
# installed torch becomes a constraint, so no dependency can replace the image's CUDA build.
# PIP_BREAK_SYSTEM_PACKAGES: newer base images install torch into the system Python, which is
# marked externally managed (PEP 668); older ones (conda) ignore the variable.
COPY requirements.txt ./
RUN grep -v -E '^torch([^A-Za-z0-9_.-]|$)' requirements.txt > /tmp/requirements-no-torch.txt \
 && python3 -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > /tmp/torch-constraint.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
        -r /tmp/requirements-no-torch.txt -c /tmp/torch-constraint.txt \
 && rm /tmp/requirements-no-torch.txt /tmp/torch-constraint.txt

COPY . .

ENTRYPOINT ["/opt/torchtitan/run_llama_train.sh"]
