"""Where the V100 profiles published by DAPPLE's authors are: `shared/profiles` beside the checkout.

CI clones the repository with shared/ beside it. A checkout without them (or with them elsewhere:
set DAPPLE_SHARED_PROFILES) skips the tests that need them, except under CI (CI=true), where a
missing directory is an error rather than a quiet skip.
"""

import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CANDIDATES = [os.environ.get("DAPPLE_SHARED_PROFILES", ""), os.path.join(_ROOT, "..", "shared", "profiles")]


def _find():
    for candidate in _CANDIDATES:
        if candidate and os.path.isfile(os.path.join(candidate, "bert-48-pbs-2.txt")):
            return os.path.abspath(candidate) + os.sep
    if os.environ.get("CI"):
        raise RuntimeError(f"the shared profiles are not in any of {_CANDIDATES}")
    return ""


PROFILES = _find()  # with a trailing separator, or "" when absent
requires_profiles = pytest.mark.skipif(not PROFILES, reason="shared profiles not found beside the checkout")
