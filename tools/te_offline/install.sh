# Source on the GPU node, from the repository root, with build/te/ (tools/te_offline/build.sh's output) present:
#   source tools/te_offline/install.sh [DIR]
# Installs the Transformer Engine set into /tmp/site-te and puts this Python's pip CUDA libraries (cuDNN,
# cudart, cuBLAS, NCCL) first on LD_LIBRARY_PATH. Measured on the workplace image: its system cuDNN 9.14
# in /lib/x86_64-linux-gnu must not be mixed with the pip cuDNN 9.19 the extension was built against
# ("undefined symbol ... libcudnn_graph.so.9"), and TE does not load NCCL itself.
_te_dir=${1:-build/te}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-te "$_te_dir"/*.whl || return 1
export PYTHONPATH=/tmp/site-te${PYTHONPATH:+:$PYTHONPATH}
_sp=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
for _d in nccl/lib cublas/lib cu13/lib cudnn/lib; do
  [ -d "$_sp/nvidia/$_d" ] && export LD_LIBRARY_PATH=$_sp/nvidia/$_d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
unset _d _sp _te_dir
python3 -c "import transformer_engine, transformer_engine.jax, transformer_engine.jax.ep; print('transformer-engine', transformer_engine.__version__, 'imports')"
