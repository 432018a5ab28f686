"""The universal store: chunked tensors (zarr or safetensors backend), exact object bytes, one metadata file.

``plan`` lays the store out before any I/O (pure); ``store`` holds the one writer and the one
reader; ``zarr_backend`` and ``safetensors_backend`` put the chunks' bytes in files. The names
below are the package's public face (``from formats.universal import UniversalReader``).
"""

from formats.universal.plan import (
    BACKENDS,
    DEFAULT_BACKEND,
    OBJECTS_DIR,
    TENSORS_DIR,
    ArrayPlan,
    StorePlan,
    array_name,
    chunk_grid,
    chunk_id,
    chunk_shape_for,
    plan_array,
    plan_store,
)
from formats.universal.store import (
    ROWS_BATCH_BYTES,
    UniversalReader,
    UniversalWriter,
    backend_module,
    chunk_box,
    chunk_name,
    is_universal_store,
    read_metadata,
)
from formats.universal_meta import METADATA_FILE

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "METADATA_FILE", "OBJECTS_DIR", "ROWS_BATCH_BYTES", "TENSORS_DIR", "ArrayPlan",
    "StorePlan", "UniversalReader", "UniversalWriter", "array_name", "backend_module", "chunk_box", "chunk_grid",
    "chunk_id", "chunk_name", "chunk_shape_for", "is_universal_store", "plan_array", "plan_store", "read_metadata",
]
