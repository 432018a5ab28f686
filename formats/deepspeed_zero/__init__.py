"""DeepSpeed checkpoints as ``engine.save_checkpoint`` writes them (ZeRO-0/1/2/3), read directly:
no ``ds_to_universal`` step, no DeepSpeed, none of its pickled classes run (see :mod:`.reader`)."""

from formats.deepspeed_zero.files import find_tag_dir, is_deepspeed_zero
from formats.deepspeed_zero.reader import FORMAT, DeepSpeedZeroReader

__all__ = ["FORMAT", "DeepSpeedZeroReader", "find_tag_dir", "is_deepspeed_zero"]
