"""``qnorm verify``: bit-exactness of every op × config on every backend.

* :mod:`.cases` — the op × config catalogue (``CASES``).
* :mod:`.vectors` — edge-case, exhaustive and seeded random input vectors.
* :mod:`.golden_store` — qnorm/data/golden: stored vectors, sha256 manifest, regeneration.
* :mod:`.backends` — the backend registry (golden, qat, x86_64, and any registered).
* :mod:`.harness` — running, comparing (equality only) and the op × backend matrix.
"""

from qnorm.verify.backends import Backend, BackendError, Runner, Unsupported, register, unregister
from qnorm.verify.cases import CASES, Case, select_cases
from qnorm.verify.golden_store import GoldenStoreError
from qnorm.verify.harness import Report, resolve_columns, verify
from qnorm.verify.vectors import DEFAULT_ELEMENTS, FULL_ELEMENTS

__all__ = [
    "CASES",
    "DEFAULT_ELEMENTS",
    "FULL_ELEMENTS",
    "Backend",
    "BackendError",
    "Case",
    "GoldenStoreError",
    "Report",
    "Runner",
    "Unsupported",
    "register",
    "resolve_columns",
    "select_cases",
    "unregister",
    "verify",
]
