"""Every tunable of ckptconv in one place (defaults; options override them)."""

from __future__ import annotations

import os

MIB = 1 << 20
GIB = 1 << 30

#: Target size of one chunk of a universal-store array (bytes).
UNIVERSAL_CHUNK_BYTES = 64 * MIB
#: Largest piece a worker holds in memory at once when filling a target (bytes).
PIECE_BYTES = 64 * MIB
#: Default memory budget for buffers in flight (bytes), shared by all workers.
MEMORY_BUDGET = 512 * MIB
#: Default number of I/O worker threads.
WORKERS = max(2, min(8, (os.cpu_count() or 2)))
#: Largest DCP `.metadata` pickle accepted (bytes).
MAX_METADATA_BYTES = 2 * GIB
#: Largest non-tensor entry accepted (bytes).
MAX_OBJECT_BYTES = 1 * GIB
