"""A C kernel loaded in one of the builds the integer_build fixture sets up."""
import pytest


def integer_library(module, build: str, supported):
    """`module`'s C library in `build` (integer_build); skips where it does not multiply in integers.

    `supported(library)` says its form (the library's int4_matmul_supported, ...)."""
    module.load_library.cache_clear()
    library = module.load_library()
    module.load_library.cache_clear()
    if library is None or supported(library) not in (module.AVX2_FORM, module.VNNI_FORM):
        pytest.skip(f"this build of {module.__name__} does not multiply in integers")
    if build != "native":
        assert supported(library) == module.AVX2_FORM
    return library
