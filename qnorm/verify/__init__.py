"""``qnorm verify``: bit-exactness of every op × config on every backend.

* :mod:`.cases` — the op × config catalogue (``CASES``).
* :mod:`.vectors` — edge-case, exhaustive and seeded random input vectors.
* :mod:`.golden_store` — qnorm/data/golden: stored vectors, sha256 manifest, regeneration.
* :mod:`.registry` — the backend registry and what a backend returns or raises.
* :mod:`.backends` — every column registered (golden, qat, x86_64, the cross, GPU and HLS ones).
* :mod:`.harness` — running, comparing (equality only) and the op × backend matrix.

The names below load on first use (PEP 562): ``qnorm verify --list`` and the
command line's checks of ``--case`` read the catalogue without loading torch.
"""

from __future__ import annotations

from qnorm._lazy import lazy_exports

_EXPORTS = {
    "CASES": "cases", "Case": "cases", "select_cases": "cases",
    "Backend": "backends", "BackendError": "backends", "Runner": "backends", "Unsupported": "backends",
    "register": "backends", "unregister": "backends",
    "GoldenStoreError": "golden_store",
    "Report": "harness", "resolve_columns": "harness", "verify": "harness",
    "DEFAULT_ELEMENTS": "vectors", "FULL_ELEMENTS": "vectors",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
