"""Finds OpenSSL's libcrypto in this process for the C core's mask expansion
(csrc/secagg.c, `ef_secagg_mask`): the addresses of the five EVP functions it calls.

The core is built without OpenSSL headers or a link to libcrypto; here, at run time, the
libcrypto that Python's own `_hashlib` / `_ssl` load (already mapped in the process; its
soname otherwise) is opened with ctypes and its EVP_* addresses are read. None when there is
no usable libcrypto (OpenSSL 1.1 or 3.x, on Linux): the masks then come from `cryptography`
(reference.secagg_mask), which is also the oracle the core's keystream is checked against
before it is used (kernels.secagg_mask)."""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import sys

_NAMES = ("EVP_CIPHER_CTX_new", "EVP_CIPHER_CTX_free", "EVP_aes_256_ctr",
          "EVP_EncryptInit_ex", "EVP_EncryptUpdate")


def _loaded_paths() -> list[str]:
    """libcrypto files already mapped into this process (Linux), e.g. by _hashlib."""
    try:
        importlib.import_module("_hashlib")    # maps libcrypto where Python links it
    except ImportError:
        pass
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcrypto" in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if ".so" in p)


def evp_addresses() -> tuple[tuple[int, ...], str] | None:
    """((address of each of _NAMES), the library's path) or None. Linux only: elsewhere the
    system's libcrypto may not be OpenSSL's (macOS aborts a process that opens its own)."""
    if not sys.platform.startswith("linux"):
        return None
    candidates = _loaded_paths() + ["libcrypto.so.3", "libcrypto.so.1.1"]
    found = ctypes.util.find_library("crypto")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in _NAMES), path
        except (OSError, AttributeError):
            continue
    return None
