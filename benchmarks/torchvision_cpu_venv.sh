#!/usr/bin/env bash
# A throwaway venv in which torchvision 0.28.0 (the release matching torch 2.13) imports beside the CPU
# torch 2.13.0, for benchmarks/data_pipeline.py --other-python DIR/python (the best peer's figures).
#
#     bash benchmarks/torchvision_cpu_venv.sh /tmp/tvenv
#
# PyPI's torchvision 0.28.0 wheel is built for CUDA: its _C.so and image.so name libc10_cuda.so and
# libtorch_cuda.so, which a CPU torch does not have, and reference 18 of their symbols (CUDA device and
# allocator functions). Its CPU code paths (decode_jpeg on CPU tensors, the v2 transforms) never call them.
# This script installs torch 2.13.0 (CPU) with what rayvit.data.images needs (run from the repo through
# PYTHONPATH, so that rayvit and torchvision run side by side in one process), then torchvision 0.28.0
# without its dependencies, and makes
# one stand-in library under DIR/stubs that defines each missing symbol as inert data (a declaration per
# name read from the wheel's own .so files with nm; no code), named as both missing libraries.
# DIR/python runs the venv's interpreter with DIR/stubs on LD_LIBRARY_PATH. Nothing here touches rayvit's
# own environment, and torchvision is never a dependency of rayvit.
set -euo pipefail
dir=${1:?usage: torchvision_cpu_venv.sh DIR}
python3 -m venv "$dir"
"$dir/bin/pip" install -q torch==2.13.0 numpy pillow simplejpeg "turbojpeg>=0.0.2" pyyaml
"$dir/bin/pip" install -q --no-deps torchvision==0.28.0
site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$dir/stubs"
(nm -D -u "$site/torchvision/_C.so"; nm -D -u "$site/torchvision/image.so") | awk '{print $2}' | grep -v "@" | sort -u \
    > "$dir/stubs/undefined.txt"
nm -D --defined-only "$site"/torch/lib/*.so | awk '{print $3}' | sed 's/@.*//' | sort -u > "$dir/stubs/defined.txt"
comm -23 "$dir/stubs/undefined.txt" "$dir/stubs/defined.txt" | grep -E '^_Z' | awk '{print "char " $1 "[256];"}' \
    > "$dir/stubs/missing.c"
gcc -shared -o "$dir/stubs/libc10_cuda.so" "$dir/stubs/missing.c"
cp "$dir/stubs/libc10_cuda.so" "$dir/stubs/libtorch_cuda.so"
cat > "$dir/python" <<WRAP
#!/usr/bin/env bash
LD_LIBRARY_PATH="$dir/stubs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$dir/bin/python" "\$@"
WRAP
chmod +x "$dir/python"
"$dir/python" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
