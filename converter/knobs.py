"""Every tunable of ckptconv in one place (defaults; options override them)."""

from __future__ import annotations

import os

MIB = 1 << 20
GIB = 1 << 30

#: Target size of one chunk of a universal-store array (bytes).
UNIVERSAL_CHUNK_BYTES = 64 * MIB
#: Largest piece a worker holds in memory at once when filling a target (bytes). 16 MiB pieces
#: stream a large target chunk through small, cache-friendlier buffers; a universal-store chunk is
#: still written whole (its size is UNIVERSAL_CHUNK_BYTES, bounded by the budget).
PIECE_BYTES = 16 * MIB
#: Default memory budget for buffers in flight (bytes), shared by all workers.
MEMORY_BUDGET = 512 * MIB
#: Write the large aligned part of each piece straight to the device (``O_DIRECT``, where the
#: destination's file system takes it): no page-cache copy and no writeback left for the commit's
#: fsyncs. Env ``CKPTCONV_DIRECT_WRITES=0`` sends every byte through the page cache.
DIRECT_WRITES = (os.environ.get("CKPTCONV_DIRECT_WRITES", "1") or "1") not in ("0", "false", "no", "off")
#: Make the many files of a universal store durable with one ``syncfs`` of their filesystem where
#: that is as safe as an fsync of each (Linux >= 5.8, ext4 / XFS / btrfs / f2fs, little other
#: dirty data: ``formats.durability``); else each file and folder is fsynced. Env
#: ``CKPTCONV_SYNCFS=0`` fsyncs each always.
SYNCFS = (os.environ.get("CKPTCONV_SYNCFS", "1") or "1") not in ("0", "false", "no", "off")
#: How far the source is read ahead of the copy (bytes of task data; 0: off): the kernel reads the
#: source chunks of the next tasks into the page cache while the workers check and write
#: (``converter.run.prefetch``). Env ``CKPTCONV_PREFETCH_MIB``.
PREFETCH_BYTES = int(float(os.environ.get("CKPTCONV_PREFETCH_MIB", "64") or 0) * MIB)
#: Source chunks larger than this are not read ahead (0: no limit, the default). Read-ahead pays
#: most where the disk waits on many small reads (1 GB, 1,470 items: every step 15-20 % faster);
#: on a disk-bound run it competes with the writes (8 GB to-universal on this VM: 8-16 % slower;
#: from-universal and the DCP reshard unchanged). Env ``CKPTCONV_PREFETCH_MAX_CHUNK_MIB``.
PREFETCH_MAX_CHUNK_BYTES = int(float(os.environ.get("CKPTCONV_PREFETCH_MAX_CHUNK_MIB", "0") or 0) * MIB)
#: Default number of I/O worker threads.
WORKERS = max(2, min(8, (os.cpu_count() or 2)))
# The limits of the on-disk formats live with them (formats/ imports nothing of converter/):
# formats.dcp.metadata.MAX_METADATA_BYTES (largest DCP `.metadata` pickle, 2 GiB) and
# formats.dcp.reader.MAX_OBJECT_BYTES (largest non-tensor entry, 1 GiB).
#: Fault injection for the resume tests: SIGKILL this process once this many bytes were written
#: by the executor (0 = off). Set through the environment only.
FAULT_KILL_AFTER_BYTES = int(os.environ.get("CKPTCONV_FAULT_KILL_AFTER_BYTES", "0") or 0)
#: Fault injection for the resume tests: SIGKILL this process when the conversion reaches this
#: point (""/unset = off): ``planned`` (before the destination is touched), ``prepared`` (the
#: destination locked and journaled, no data yet), ``committed`` (the completion marker written,
#: the journals not yet removed). Set through the environment only.
FAULT_KILL_AT = os.environ.get("CKPTCONV_FAULT_KILL_AT", "")
#: Seconds between plain progress lines when stderr is not a terminal (env for tests and logs).
PROGRESS_LINE_SECONDS = float(os.environ.get("CKPTCONV_PROGRESS_SECONDS", "5.0") or 5.0)
#: Fault injection for the interrupt and lock tests: each worker sleeps this long before every
#: piece (0 = off), so a small conversion runs for seconds. Set through the environment only.
FAULT_SLOW_PIECE_SECONDS = float(os.environ.get("CKPTCONV_FAULT_SLOW_PIECE_SECONDS", "0") or 0)
#: Fault injection for the lock tests: while this file exists, each worker waits before its next
#: piece (""/unset = off), so a run stays in progress for as long as a test needs, however loaded
#: the machine. Set through the environment only.
FAULT_HOLD_FILE = os.environ.get("CKPTCONV_FAULT_HOLD_FILE", "")
#: After a task completes, the executor's main loop lets others complete for this long before it
#: looks: it wakes at most ~100 times a second, not once per task (each wake takes the GIL from the
#: workers: 37,000 small tasks cost 780,000 futex calls when it woke per task).
COMPLETION_BATCH_SECONDS = 0.01
#: Seconds between journal batches (data fsync + journal append) of a conversion.
JOURNAL_FLUSH_SECONDS = float(os.environ.get("CKPTCONV_JOURNAL_FLUSH_SECONDS", "2.0") or 2.0)
#: Seconds a file that many tasks write (a DCP rank file) may go unsynced while some of its tasks
#: are still running: a batch makes such a file durable (so that --resume keeps its finished tasks)
#: only once all of this run's tasks into it are done, or once it was last synced this long ago.
#: A shorter run syncs each file once. None (unset): 30x JOURNAL_FLUSH_SECONDS (60 s; 0 with it).
_OPEN = os.environ.get("CKPTCONV_JOURNAL_OPEN_FILE_SECONDS")
JOURNAL_OPEN_FILE_SECONDS: float | None = float(_OPEN) if _OPEN else None
#: Where a conversion to a URL destination spools its output before uploading (a fresh
#: ``ckptconv-spool-*`` directory is made under it; None = the system temp dir). Universal outputs
#: stream through it (chunks uploaded and deleted as they are written: about twice the memory
#: budget); DCP and HF outputs need room for the whole output. Env ``CKPTCONV_SPOOL_DIR``; the
#: ``--spool-dir`` option overrides it.
SPOOL_DIR = os.environ.get("CKPTCONV_SPOOL_DIR") or None
#: Seconds a ``--plan torchtitan:...`` / ``python:...`` subprocess may take to build and
#: parallelize the model on the meta device (env ``CKPTCONV_CODE_PLAN_TIMEOUT_S``).
CODE_PLAN_TIMEOUT_S = int(os.environ.get("CKPTCONV_CODE_PLAN_TIMEOUT_S", "600") or 600)
#: Float32 work of one slab when (de)quantizing block-scaled weights (bytes): a region is computed
#: slab by slab, so a worker's extra memory is one slab (plus its data) whatever the region.
QUANT_SLAB_BYTES = 4 * MIB
#: FP8 scales an export keeps from its weight reads for the ``weight_scale_inv`` tensors (bytes);
#: past it a scale tensor quantizes its weight again (same bits, one more read).
QUANT_SCALE_MEMO_BYTES = 64 * MIB
#: Print where a conversion's wall time went (process start, imports, planning, destination,
#: copy, commit) as one ``ckptconv: timings:`` line on stderr (``bench/`` profiles the data path
#: with it). Env ``CKPTCONV_TIMINGS=1``.
TIMINGS = (os.environ.get("CKPTCONV_TIMINGS", "") or "0") not in ("0", "false", "no", "off")
