#!/usr/bin/env bash
# Assembles a CUDA 12.4 toolkit that nvcc and setup.py can use (CUDA_HOME=DEST), from packages
# alone, on a machine with CUDA 13 or no CUDA at all:
#   PyPI    nvidia-cuda-nvcc-cu12     libdevice and the nvcc-internal headers (crt/) of 12.4.131,
#                                     nvcc's release; ptxas of 12.9.86 (12.4's serializes the
#                                     Hopper kernels' wgmma: ptxas C7513, "Potential Performance
#                                     Loss", where 12.9's and 13.0's do not)
#           nvidia-cuda-runtime-cu12  the runtime headers (12.4.127, nvcc's release) and
#                                     libcudart_static.a (12.9.79: the runtime wheels before
#                                     12.9 hold only libcudart.so.12)
#   Debian  nvidia-cuda-toolkit       the nvcc driver, cicc, cudafe++, fatbinary (trixie's
#                                     non-free section, read with apt through a private state
#                                     folder: the machine's apt configuration is not touched)
# PyPI's nvidia-cuda-nvcc-cu12 wheels (12.0 to 12.9) hold ptxas and libnvvm but not nvcc itself,
# nor cicc, cudafe++ or fatbinary, hence Debian's package for those; its 12.4.131 is the same
# release as the PyPI headers below.  Usage: cuda12-toolkit.sh DEST (idempotent: a DEST put
# together from the same pins is kept).
set -euo pipefail

DEST=$(realpath -m "${1:?usage: cuda12-toolkit.sh DEST}")  # apt wants absolute folders
NVCC_PYPI=12.4.131
PTXAS_PYPI=12.9.86
RUNTIME_HEADERS_PYPI=12.4.127
RUNTIME_STATIC_PYPI=12.9.79
DEBIAN_SUITE=trixie
DEBIAN_TOOLKIT=12.4.131~12.4.1-2
RELEASE=12.4
PYTHON=${PYTHON:-python3}

RECIPE="debian $DEBIAN_SUITE nvidia-cuda-toolkit=$DEBIAN_TOOLKIT; pypi nvidia-cuda-nvcc-cu12==$NVCC_PYPI"
RECIPE="$RECIPE (ptxas ==$PTXAS_PYPI), nvidia-cuda-runtime-cu12==$RUNTIME_HEADERS_PYPI (headers)"
RECIPE="$RECIPE ==$RUNTIME_STATIC_PYPI (libcudart_static.a)"
if [ -x "$DEST/bin/nvcc" ] && [ "$(cat "$DEST/recipe.txt" 2>/dev/null)" = "$RECIPE" ]; then
    exit 0
fi
work="$DEST.download"    # everything is put together here and moved to DEST at the end, so
stage="$work/toolkit"    # an interrupted run leaves no DEST that looks complete
rm -rf "$DEST" "$work"
mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial" "$work/pypi" "$work/deb"

for pin in "nvidia-cuda-nvcc-cu12==$NVCC_PYPI" "nvidia-cuda-nvcc-cu12==$PTXAS_PYPI" \
    "nvidia-cuda-runtime-cu12==$RUNTIME_HEADERS_PYPI" "nvidia-cuda-runtime-cu12==$RUNTIME_STATIC_PYPI"; do
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/pypi/${pin#*==}" "$pin"
    "$PYTHON" -m zipfile -e "$work/pypi/${pin#*==}"/*.whl "$work/pypi/${pin#*==}/tree"
done

echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $DEBIAN_SUITE non-free" \
    >"$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State=$work/apt" -o "Dir::Cache=$work/apt" -o Dir::State::status=/dev/null
          -o APT::Architecture=amd64 -o APT::Sandbox::User=root -qq)
apt-get "${apt_opts[@]}" update
(cd "$work/deb" && apt-get "${apt_opts[@]}" download "nvidia-cuda-toolkit=$DEBIAN_TOOLKIT")
dpkg-deb -x "$work"/deb/nvidia-cuda-toolkit_*.deb "$work/deb/tree"

nvcc_wheel="$work/pypi/$NVCC_PYPI/tree/nvidia/cuda_nvcc"
ptxas_wheel="$work/pypi/$PTXAS_PYPI/tree/nvidia/cuda_nvcc"
headers_wheel="$work/pypi/$RUNTIME_HEADERS_PYPI/tree/nvidia/cuda_runtime"
static_wheel="$work/pypi/$RUNTIME_STATIC_PYPI/tree/nvidia/cuda_runtime"
deb="$work/deb/tree/usr"
mkdir -p "$stage/bin" "$stage/nvvm/bin" "$stage/nvvm/libdevice" "$stage/include" "$stage/lib64"
cp "$deb/lib/nvidia-cuda-toolkit/bin/nvcc" "$deb/bin/cudafe++" "$deb/bin/fatbinary" "$stage/bin/"
cp "$ptxas_wheel/bin/ptxas" "$stage/bin/"
cp "$deb/lib/nvidia-cuda-toolkit/bin/cicc" "$stage/nvvm/bin/"
cp "$nvcc_wheel/nvvm/libdevice/libdevice.10.bc" "$stage/nvvm/libdevice/"
cp -r "$nvcc_wheel/include/." "$headers_wheel/include/." "$stage/include/"
cp "$static_wheel/lib/libcudart_static.a" "$static_wheel/lib/libculibos.a" "$stage/lib64/"
find "$stage/include" -name __init__.py -delete
chmod +x "$stage"/bin/* "$stage/nvvm/bin/cicc"
# nvcc reads nvcc.profile next to itself: where cicc, libdevice, the headers and libraries are.
cat >"$stage/bin/nvcc.profile" <<'PROFILE'
TOP                = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH              += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES          += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES         =+ $(_SPACE_) "-L$(TOP)/lib64"
PROFILE
"$stage/bin/nvcc" --version | grep -q "release $RELEASE," || {
    echo "cuda12-toolkit.sh: $DEST/bin/nvcc is not CUDA $RELEASE" >&2
    exit 1
}
echo "$RECIPE" >"$stage/recipe.txt"
mv "$stage" "$DEST"
rm -rf "$work"
