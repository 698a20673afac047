"""What a release wheel (`make wheel`) promises about itself, checked on the diffkv that is
imported: under `make test-wheel` that is the installed wheel, in a development build these
check that nothing claims to be a release.  A release carries a local version label naming its
variant (0.1.0+cu13), the label agrees with the CUDA the extension was compiled with, and its
extension exports PyInit__C alone (packaging/check_wheel.py checks the same on the file)."""

import ctypes
import re

import diffkv
from diffkv import _C

RELEASE = re.fullmatch(r"[0-9.]+\+(cu[0-9]+|cpu)", diffkv.__version__)


def test_version_is_plain_or_a_release_label():
    plain = re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", diffkv.__version__)
    assert RELEASE is not None or plain is not None, diffkv.__version__


def test_release_label_names_the_compiled_cuda():
    if RELEASE is None:
        return  # a development build: no label to agree with
    build = _C.build_info()
    expected = f"cu{build['cuda_runtime_version'] // 1000}" if build["cuda_compiled"] else "cpu"
    assert RELEASE.group(1) == expected, (diffkv.__version__, build)


def test_release_exports_the_module_init_alone():
    library = ctypes.PyDLL(_C.__file__)
    assert hasattr(library, "PyInit__C")
    # dk_driver_check is in every build; a development build exports it (tests/test_build.py
    # reads symbols that way), a release wheel's version script hides it
    assert hasattr(library, "dk_driver_check") == (RELEASE is None)
