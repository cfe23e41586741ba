# Source on a GPU machine without network access (from the repository root) before running anything of kvtransform
# there:  source tools/device_env.sh && python3 -P tools/...
# Such an image has torch/triton/transformers but no hydra-core, omegaconf or gguf: their wheels travel in .whl/ (copy
# it along with the checkout). kvtransform itself is installed into /tmp/site (not editable), so every run uses the
# working tree that was copied there. Fill .whl/ on a machine with network access (Python 3.12, x86-64 Linux):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0 gguf==0.17.1
#   pip download --no-deps -d /tmp/antlr antlr4-python3-runtime==4.9.3 && pip wheel --no-deps -w .whl /tmp/antlr/antlr4*
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site . >/tmp/kvt_install.log 2>&1 || { cat /tmp/kvt_install.log; return 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, triton, transformers; print('device env: torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
