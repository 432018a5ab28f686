"""Megatron-LM / megatron-core checkpoints beside DCP's own: the legacy ``mp_rank`` layout
(``--ckpt-format torch``), its names and its distributed optimizer's flat buffers.

- :mod:`formats.megatron.names`: a model's state-dict names and megatron-core's sharded keys (pure);
- :mod:`formats.megatron.buffers`: the DistributedOptimizer's flat buffer layout (pure);
- :mod:`formats.megatron.folders`: the ``iter_*/mp_rank_*`` folders of a legacy checkpoint;
- :mod:`formats.megatron.legacy`: the legacy checkpoint reader.

The torch_dist format itself is a DCP checkpoint (:mod:`formats.dcp`, ``framework_files``).
"""
